"""GET /system: open, no content; what runs where, for a console to poll before it has a key."""

from __future__ import annotations

import logging
import time
from functools import cache
from pathlib import Path
from typing import Any

import gmlx
from gmlx import platform
from gmlx.server import host
from gmlx.server.state import ServerState

log = logging.getLogger("gmlx.system")


@cache
def _nvml() -> Any | None:
    """pynvml, initialised once; None where there is no NVIDIA driver (not an error)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception:
        return None


def gpu_telemetry() -> list[dict] | None:
    nvml = _nvml()
    if nvml is None:
        return None
    gpus = []
    for i in range(nvml.nvmlDeviceGetCount()):
        h = nvml.nvmlDeviceGetHandleByIndex(i)
        mem = nvml.nvmlDeviceGetMemoryInfo(h)
        gpus.append(
            {
                "index": i,
                "name": _best_effort(lambda h=h: nvml.nvmlDeviceGetName(h)),
                "utilization_pct": _best_effort(lambda h=h: nvml.nvmlDeviceGetUtilizationRates(h).gpu),
                "memory_total_bytes": int(mem.total),
                "memory_used_bytes": int(mem.used),
                "temperature_c": _best_effort(lambda h=h: nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU)),
                "power_w": _best_effort(lambda h=h: nvml.nvmlDeviceGetPowerUsage(h) / 1000),
            }
        )
    return gpus


def _best_effort(read: Any) -> Any:
    try:
        return read()
    except Exception:  # a field this GPU or driver does not report
        return None


def system_info(state: ServerState) -> dict:
    serving = next((m for m in [state.default, *state.resident()] if m.ready), state.default)
    loaded = serving.engine.loaded if serving.engine is not None else None
    if state.closed:
        status = "draining"
    elif state.cold:
        status = "unloaded"  # idle past its keep-alive: the next request loads it
    elif state.ready:
        status = "ready"
    else:
        status = "loading"
    compute = platform.backend()
    if loaded is not None:
        # gguf: the file's blocks through gmlx.kernels (named with the ISA), e.g. cpu/gguf-blocks-avx2+openblas
        dtype = {"float": "float32", "gguf": "gguf-blocks"}.get(loaded.mode, "affine-quantized")
        if loaded.mode == "gguf":
            from gmlx import kernels

            dtype += f"-{kernels.isa()}"
        compute += f"/{dtype}" + (f"+{gmlx.BLAS.name}" if platform.backend() == "cpu" else "")
    gates = [m.gate for m in state.models.values()]
    return {
        "version": gmlx.__version__,
        "state": status,
        "uptime_s": round(time.time() - state.started_at, 1),
        "device": platform.device_name(),
        "compute_type": compute,
        "model": serving.model_id,  # whose compute_type this is
        "gpu": gpu_telemetry(),
        "host": host.telemetry(),  # CPU per core and RSS: what a console shows without a GPU
        "activity": {"active": sum(g.running for g in gates), "waiting": sum(g.waiting for g in gates)},
        "models": {
            "active": serving.model_id,
            "loaded": [m.model_id for m in state.resident() if m.ready],
            "available": available_models(state),
        },
    }


def available_models(state: ServerState) -> list[dict]:
    """Every model a request may name, the preloaded one first: name (its id), size, status and
    whether a preset names it. No paths: /system is open to anyone who can reach the server."""
    return [
        {
            "name": m.model_id,
            "size_bytes": _size(m.deployment.path),
            "status": m.status,
            "preset": m.deployment.origin == "preset",
        }
        for m in state.models.values()
    ]


def models_dir_files(folder: str | None) -> dict[str, Path]:
    """The models directory's *.gguf files by model id (their stem). pathlib's glob skips what it
    cannot read; /system is polled, so no log."""
    return {f.stem: f for f in Path(folder).glob("*.gguf") if f.is_file()} if folder else {}


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:  # removed or unreadable since it was listed
        return None
