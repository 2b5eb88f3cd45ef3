"""GET /system: open, no content; what runs where, for a console to poll before it has a key."""

from __future__ import annotations

import logging
import time
from functools import cache
from pathlib import Path
from typing import Any

import gmlx
from gmlx import platform
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
    loaded = state.engine.loaded
    if state.gate.closed:
        status = "draining"
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
    return {
        "version": gmlx.__version__,
        "state": status,
        "uptime_s": round(time.time() - state.started_at, 1),
        "device": platform.device_name(),
        "compute_type": compute,
        "model": state.model_id,
        "gpu": gpu_telemetry(),
        "activity": {"active": state.gate.running, "waiting": state.gate.waiting},
        "models": {"active": state.model_id, "available": available_models(state)},
    }


def available_models(state: ServerState) -> list[dict]:
    """The served model, then each other *.gguf in the models directory: name (as a model id)
    and size. No paths: /system is open to anyone who can reach the server."""
    loaded = state.engine.loaded
    served = loaded.header.path if loaded is not None else None
    models = [{"name": state.model_id, "size_bytes": _size(served) if served else None}]
    others = models_dir_files(state.settings.models_dir)
    models += [{"name": name, "size_bytes": _size(f)} for name, f in sorted(others.items()) if name != state.model_id]
    return models


def models_dir_files(folder: str | None) -> dict[str, Path]:
    """The models directory's *.gguf files by model id (their stem). pathlib's glob skips what it
    cannot read; /system is polled, so no log."""
    return {f.stem: f for f in Path(folder).glob("*.gguf") if f.is_file()} if folder else {}


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:  # removed or unreadable since it was listed
        return None
