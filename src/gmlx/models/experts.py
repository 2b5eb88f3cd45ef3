"""Mixture-of-experts layers over GGUF block weights (the `gguf` weight mode), for mlx_lm's SwitchGLU.

llama.cpp's converter merges a layer's experts into one 3-D tensor per projection ([n_expert, out, in] in MLX
order); in `gguf` mode it stays the file's blocks, (n_expert, out, row_bytes) uint8. The kernels of
gmlx.kernels multiply one 2-D block matrix at a time, so GGUFSwitchGLU routes on the host: it reads the
chosen expert ids (one sync per MoE layer), groups the token rows by expert, and runs each used expert's
gate/up/down as one fused GatedMLP kernel call over its rows. Each expert is a view of the layer's
tensor, evaluated once here, so no call copies weights.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_unflatten

from gmlx.gguf.header import GGUFError
from gmlx.kernels import ACTIVATIONS, extension

_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class GGUFSwitchLinear(nn.Module):
    """One projection of every expert in the file's blocks: `weight` (n_expert, out, row_bytes) uint8."""

    def __init__(self, weight: mx.array, ggml_type: int, input_dims: int):
        super().__init__()
        self.ggml_type, self.input_dims = int(ggml_type), input_dims
        self.num_experts, self.output_dims = weight.shape[:2]
        self.weight = weight
        self.freeze()

    def experts(self) -> list[mx.array]:
        mx.eval(self.weight)
        views = [self.weight[e] for e in range(self.num_experts)]
        mx.eval(views)  # evaluated views share the tensor's buffer and reach the kernel without a copy
        return views


class GGUFSwitchGLU(nn.Module):
    """mlx_lm's SwitchGLU, down(silu(gate(x)) * up(x)) per chosen expert, with the projections in blocks on
    gmlx.kernels: all three in one fused GatedMLP kernel call per used expert; where a projection stayed float
    (a type the kernels lack, e.g. Q3_K gate/up beside a Q5_K down), each projection on its own. Keeps
    SwitchGLU's names, so parameters and resident bytes do not change."""

    def __init__(self, gate_proj: nn.Module, up_proj: nn.Module, down_proj: nn.Module):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj
        projections = (gate_proj, up_proj, down_proj)
        self._fused = all(isinstance(p, GGUFSwitchLinear) for p in projections)
        self._types = [getattr(p, "ggml_type", -1) for p in projections]
        self._experts = list(
            zip(*(p.experts() if isinstance(p, GGUFSwitchLinear) else [None] * p.num_experts for p in projections))
        )

    def _expert(self, e: int, x: mx.array) -> mx.array:
        ext = extension()
        views = self._experts[e]
        ff, dims = self.gate_proj.output_dims, self.gate_proj.input_dims
        if self._fused:
            return ext.gguf_gated_mlp(x, *views, self._types, ff, dims, ACTIVATIONS["silu"], stream=mx.cpu)

        def project(p: nn.Module, view: mx.array | None, v: mx.array) -> mx.array:
            if view is None:
                return v @ p.weight[e].T
            return ext.gguf_matmul(v, view, p.ggml_type, p.output_dims, p.input_dims, stream=mx.cpu)

        g, u, d = views
        h = nn.silu(project(self.gate_proj, g, x)) * project(self.up_proj, u, x)
        return project(self.down_proj, d, h)

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        lead, k, dims = indices.shape[:-1], indices.shape[-1], x.shape[-1]
        rows = x.reshape(-1, dims)
        chosen = np.array(indices.reshape(-1))  # (tokens * k,): the host sync
        order = np.argsort(chosen, kind="stable")
        experts, starts = np.unique(chosen[order], return_index=True)
        bounds = [*starts[1:], len(order)]
        outs = [
            self._expert(e, rows[mx.array(order[lo:hi] // k)])
            for e, lo, hi in zip(experts.tolist(), starts.tolist(), bounds)
        ]
        y = mx.concatenate(outs) if len(outs) > 1 else outs[0]
        y = y[mx.array(np.argsort(order))]  # back to (token, slot) order
        return y.reshape(*lead, k, dims)


def use_gguf_experts(model: nn.Module, blocks: dict[str, tuple[mx.array, int]]) -> dict[str, tuple[mx.array, int]]:
    """Swap each SwitchGLU with a projection in `blocks` for a GGUFSwitchGLU; returns the blocks left for the
    2-D layers."""
    left = dict(blocks)
    swaps = []
    for path, module in model.named_modules():
        if type(module).__name__ != "SwitchGLU" or not any(f"{path}.{p}" in blocks for p in _PROJECTIONS):
            continue
        layers = []
        for proj in _PROJECTIONS:
            name, float_layer = f"{path}.{proj}", module[proj]
            if name not in left:
                layers.append(float_layer)
                continue
            w, ggml_type = left.pop(name)
            n_expert, rows, k = float_layer.weight.shape  # the float layer mlx_lm built: (expert, out, in)
            if w.shape[:2] != (n_expert, rows):
                raise GGUFError(
                    f"{name}: {tuple(w.shape[:2])} experts x rows in the file, the model expects {(n_expert, rows)}"
                )
            layers.append(GGUFSwitchLinear(w, ggml_type, k))
        swaps.append((path, GGUFSwitchGLU(*layers)))
    model.update_modules(tree_unflatten(swaps))
    return left
