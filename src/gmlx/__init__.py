"""gmlx: serve GGUF language models on MLX."""

from gmlx.heap import keep_numpy_off_huge_pages as _keep_numpy_off_huge_pages
from gmlx.heap import map_large_buffers as _map_large_buffers
from gmlx.platform import keep_fd_limit as _keep_fd_limit
from gmlx.platform import prepare as _prepare_platform

__version__ = "0.1.0"

# Before anything imports mlx: an optimized BLAS must be loaded first to be used.
BLAS = _prepare_platform()
_keep_fd_limit()  # before mlx_lm is imported, which would set it
# Before the process allocates much: every large buffer a mapping of its own where the heap has no
# room for it, and no heap memory left advised for huge pages (gmlx/heap.py).
_map_large_buffers()
_keep_numpy_off_huge_pages()
