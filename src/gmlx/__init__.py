"""gmlx: serve GGUF language models on MLX."""

from gmlx.platform import prepare as _prepare_platform

__version__ = "0.1.0"

# Before anything imports mlx: an optimized BLAS must be loaded first to be used.
BLAS = _prepare_platform()
