"""`gmlx inspect`: what a GGUF file holds and what serving it will cost, from the header alone."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import typer
from rich.table import Table

import gmlx
from gmlx import platform
from gmlx.capacity.memory import KVFormat, kv_layer_kinds
from gmlx.capacity.table import kv_float
from gmlx.cli.common import (
    JSON_OPT,
    MODEL_ARG,
    console,
    fail,
    human_bytes,
    model_errors,
    model_path,
    print_json,
    warn_if_slow_blas,
)
from gmlx.gguf.header import read_header
from gmlx.models import check_supported
from gmlx.models.weights_mode import WeightsOption, choose_mode, resident_bytes


def describe(model: str | None, weights: WeightsOption) -> dict[str, Any]:
    path = model_path(model)
    with model_errors():
        h = read_header(path)
        check_supported(h.architecture)  # a model gmlx cannot load is an error here too, not a table
    g = h.geometry
    mode = choose_mode(weights, h)
    kv_heads = sorted(set(g.n_kv_heads))
    from gmlx.kernels import fast  # imports mlx: after the platform's bring-up

    float_bytes, float_why = kv_float(fast.enabled())
    kv = KVFormat(float_bytes=float_bytes)  # what the server allocates, as `gmlx plan` counts it
    return {
        "path": str(path),
        "architecture": g.architecture,
        "name": g.name,
        "parameters": g.n_params,
        "file_bytes": g.file_bytes,
        "tensor_types": g.tensor_types,
        "layers": g.n_layers,
        "attention_heads": g.n_heads,
        "kv_heads": kv_heads[0] if len(kv_heads) == 1 else list(g.n_kv_heads),
        "key_length": g.key_length,
        "value_length": g.value_length,
        "sliding_window": g.sliding_window,
        "sliding_layers": sum(g.sliding_layers),
        "context_length": g.context_length,
        "vocab_size": g.vocab_size,
        "chat_template": g.has_chat_template,
        "kv_format": {"value": kv.describe(), "from": float_why, "element_bytes": kv.element_bytes()},
        "kv_bytes_per_token": {k.kind: asdict(k) for k in kv_layer_kinds(g, kv)},
        "weights": {"mode": mode, "resident_bytes": resident_bytes(h, mode)},
        "platform": {
            "backend": platform.backend(),
            "blas": gmlx.BLAS.name,
            "blas_path": gmlx.BLAS.path,
            "gguf_kernels": _kernels(),
        },
    }


def _kernels_line(k: dict[str, Any]) -> str:
    if k["isa"] is None:
        return f"not used: {k['reason']}"
    return f"{k['isa']}; norms, RoPE and attention as single nodes: {'on' if k['fast_ops'] else 'off'}"


def _kernels() -> dict[str, Any]:
    """gmlx.kernels (the `gguf` weight mode): the ISA it runs on here, or why MLX's own kernels are used."""
    from gmlx import kernels
    from gmlx.kernels import fast

    reason = kernels.reason()
    return {"isa": kernels.isa() if reason is None else None, "reason": reason, "fast_ops": fast.enabled()}


def inspect_command(
    model: str = MODEL_ARG,
    weights: str = typer.Option("auto", help="Weight mode to report on: auto, native, float or gguf."),
    json_out: bool = JSON_OPT,
) -> None:
    """Show a model's architecture, geometry, quantization and KV-cache cost, from its header."""
    if weights not in ("auto", "native", "float", "gguf"):
        fail(f"--weights must be auto, native, float or gguf, not {weights!r}", 2)
    info = describe(model, weights)  # type: ignore[arg-type]
    if json_out:
        print_json(info)
        return
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column()
    kv = ", ".join(
        f"{k['kind']} x{k['layers']}: {human_bytes(k['bytes_per_token'])}/token"
        + (f" (window {k['window']})" if k["window"] else "")
        for k in info["kv_bytes_per_token"].values()
    )
    rows = [
        ("model", f"{info['name']} ({info['architecture']})"),
        ("file", f"{info['path']} ({human_bytes(info['file_bytes'])})"),
        ("parameters", f"{info['parameters'] / 1e6:,.1f} M"),
        ("tensor types", ", ".join(f"{t} x{n}" for t, n in info["tensor_types"].items())),
        ("layers", str(info["layers"])),
        ("heads", f"{info['attention_heads']} attention, {info['kv_heads']} KV"),
        ("key / value width", f"{info['key_length']} / {info['value_length']}"),
        (
            "sliding window",
            f"{info['sliding_window']} on {info['sliding_layers']} layers" if info["sliding_window"] else "none",
        ),
        ("context", f"{info['context_length']:,} tokens"),
        ("vocabulary", f"{info['vocab_size']:,}"),
        ("chat template", "in file" if info["chat_template"] else "none (architecture default)"),
        (f"KV cache {info['kv_format']['value']}", f"{kv} ({info['kv_format']['from']}; unquantized)"),
        ("weights", f"{info['weights']['mode']}, {human_bytes(info['weights']['resident_bytes'])} resident"),
        ("platform", f"{info['platform']['backend']}, BLAS {info['platform']['blas']}"),
        ("gguf kernels", _kernels_line(info["platform"]["gguf_kernels"])),
    ]
    for key, value in rows:
        table.add_row(key, value)
    console.print(table)
    warn_if_slow_blas()
