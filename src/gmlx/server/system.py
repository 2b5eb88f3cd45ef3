"""GET /system: open, no content; what runs where, for a console to poll before it has a key."""

from __future__ import annotations

import logging
from functools import cache
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
        gpus.append({
            "index": i,
            "name": _best_effort(lambda: nvml.nvmlDeviceGetName(h)),
            "utilization_pct": _best_effort(lambda: nvml.nvmlDeviceGetUtilizationRates(h).gpu),
            "memory_total_bytes": int(mem.total),
            "memory_used_bytes": int(mem.used),
            "temperature_c": _best_effort(lambda: nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU)),
            "power_w": _best_effort(lambda: nvml.nvmlDeviceGetPowerUsage(h) / 1000),
        })
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
        "device": platform.device_name(),
        "compute_type": compute,
        "model": state.model_id,
        "gpu": gpu_telemetry(),
        "activity": {"active": state.gate.running, "waiting": state.gate.waiting},
        "models": {"active": state.model_id, "available": [state.model_id]},
    }
