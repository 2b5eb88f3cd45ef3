"""Bring-up before the first `import mlx`, and facts about the device and memory.

On Linux the CPU wheel of MLX links the reference BLAS, so its float matmul runs at
a few GFLOP/s. Loading an optimized BLAS with RTLD_GLOBAL first makes MLX resolve
`sgemm_` and friends to it (about 30x faster here). Call `prepare()` before
anything imports `mlx`; `gmlx/__init__.py` does.
"""

from __future__ import annotations

import ctypes
import glob
import os
import resource
import sys
import sysconfig
from dataclasses import dataclass
from functools import cache
from pathlib import Path

BLAS_INSTALL_HINT = "sudo apt-get install libopenblas0-pthread  (Debian/Ubuntu)"
# cgroup v2, then v1: the memory limit a container is held to.
CGROUP_LIMIT_FILES = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))
_BLAS_NAMES = ("libopenblas.so.0", "libopenblas.so", "libopenblasp-r0.so")


@dataclass(frozen=True)
class BlasInfo:
    name: str  # "openblas", "reference" (MLX's own), or "accelerate"/"none" off Linux
    path: str | None


def usable_cpus() -> int:
    """CPUs this process may run on (a container's cpuset, taskset's mask), as the kernels count
    them for their threads; the machine's count where the platform cannot say."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _blas_candidates() -> list[str]:
    """Paths where an OpenBLAS may live, most specific first."""
    found: list[str] = []
    if env := os.environ.get("GMLX_BLAS"):
        found.append(env)
    multiarch = sysconfig.get_config_var("MULTIARCH") or ""
    dirs = [
        f"/usr/lib/{multiarch}/openblas-pthread",
        f"/usr/lib/{multiarch}",
        "/usr/lib64",
        "/usr/lib",
        "/usr/local/lib",
    ]
    for d in dirs:
        for name in _BLAS_NAMES:
            found.extend(sorted(glob.glob(os.path.join(d, name))))
    return found


def keep_fd_limit() -> None:
    """mlx_lm sets the open-file limit to (2048, 4096) when imported, for checkpoints of many files:
    under a hard limit below 4096 that raises (and every command failed to start), and above it the
    hard limit is lowered for good, which caps the server's connections (server/connections.py).
    gmlx reads one GGUF file, so that one call is skipped; every other caller's goes through."""
    if getattr(resource.setrlimit, "gmlx_keeps_fd_limit", False):
        return
    setrlimit = resource.setrlimit

    def guarded(which: int, limits: tuple[int, int]) -> None:
        if which == resource.RLIMIT_NOFILE and sys._getframe(1).f_globals.get("__name__") == "mlx_lm.utils":
            return
        setrlimit(which, limits)

    guarded.gmlx_keeps_fd_limit = True  # type: ignore[attr-defined]
    resource.setrlimit = guarded


@cache
def prepare() -> BlasInfo:
    """Preload an optimized BLAS on Linux; idempotent. Must run before `import mlx`."""
    if not sys.platform.startswith("linux"):
        return BlasInfo("accelerate" if sys.platform == "darwin" else "none", None)
    if os.environ.get("GMLX_BLAS") == "reference":
        return BlasInfo("reference", None)
    # One OpenBLAS thread per usable CPU was fastest here; respect a user's own choice.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", str(usable_cpus()))
    for path in _blas_candidates():
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        return BlasInfo("openblas", path)
    return BlasInfo("reference", None)


def blas_warning(info: BlasInfo) -> str | None:
    """A one-line warning when MLX's float matmul will run on the reference BLAS."""
    if info.name != "reference" or backend() != "cpu":
        return None
    return f"no optimized BLAS found: float matmul on the CPU will be slow. Install OpenBLAS: {BLAS_INSTALL_HINT}"


@cache
def backend() -> str:
    """ "metal", "cuda" or "cpu": where MLX runs by default."""
    import mlx.core as mx

    if mx.metal.is_available():
        return "metal"
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available():
        return "cuda"
    return "cpu"


def device_name() -> str:
    import mlx.core as mx

    try:
        info = mx.device_info()
    except Exception:
        return backend()
    return str(info.get("device_name") or info.get("architecture") or backend())


def total_memory_bytes() -> int:
    """Memory the model's arrays live in: the GPU's own on CUDA, else system RAM, or the
    cgroup's limit when that is smaller (a container's share, which psutil does not see)."""
    import psutil

    if backend() == "cuda":
        try:
            import mlx.core as mx

            size = mx.device_info().get("memory_size")
            if size:
                return int(size)
        except Exception:
            pass
    total = int(psutil.virtual_memory().total)
    for path in CGROUP_LIMIT_FILES:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit():  # v2 says "max" when unlimited; v1's huge number loses to min()
            total = min(total, int(text))
    return total


def available_memory_bytes() -> int:
    import psutil

    return int(psutil.virtual_memory().available)
