"""A GGUF file -> an mlx_lm model, its tokenizer and chat template."""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.tokenizer_utils import TokenizerWrapper

from gmlx.gguf.header import GGUFError, GGUFHeader, ModelGeometry, read_header
from gmlx.gguf.tensors import GGUF_BLOCKS, LoadReport, load_tensors
from gmlx.gguf.tokenizer import load_tokenizer
from gmlx.kernels import in_huge_pages, pack_weights
from gmlx.models import check_supported
from gmlx.models.architecture import Architecture
from gmlx.models.deepseek2 import DeepSeek2
from gmlx.models.experts import use_gguf_experts
from gmlx.models.fused import fuse_attention
from gmlx.models.gemma2 import Gemma2
from gmlx.models.gemma3 import Gemma3
from gmlx.models.llama import Granite, Llama, SmolLM3
from gmlx.models.moe import Qwen2Moe, Qwen3Moe
from gmlx.models.olmo2 import Olmo2
from gmlx.models.phi3 import Phi3
from gmlx.models.qwen import Qwen2, Qwen3
from gmlx.models.weights_mode import WeightsOption, choose_mode, gguf_kernels_reason

ARCHITECTURES: dict[str, Architecture] = {
    a.gguf_name: a
    for a in (
        Llama(),
        Qwen2(),
        Qwen3(),
        Gemma2(),
        Gemma3(),
        Phi3(),
        Granite(),
        Olmo2(),
        SmolLM3(),
        Qwen2Moe(),
        Qwen3Moe(),
        DeepSeek2(),
    )
}
_SUFFIXES = ("weight", "bias", "scales", "biases")
_NAMES_SHOWN = 3  # parameter names an error lists before "and N more"

Progress = Callable[[str], None]


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: TokenizerWrapper
    header: GGUFHeader
    mode: str  # "native", "float" or "gguf"
    report: LoadReport
    load_seconds: float
    max_kv_size: int | None = None  # the server's cap on the context window (None: none)

    @property
    def geometry(self) -> ModelGeometry:
        return self.header.geometry

    @property
    def model_id(self) -> str:
        return self.header.path.stem

    @property
    def context_length(self) -> int:
        """The window this model serves: the GGUF's trained one, or max_kv_size when smaller."""
        trained = self.geometry.context_length
        return trained if self.max_kv_size is None else min(trained, self.max_kv_size)


def architecture_for(h: GGUFHeader) -> Architecture:
    check_supported(h.architecture)
    return ARCHITECTURES[h.architecture]


def load(
    path: str | Path, weights: WeightsOption = "auto", progress: Progress | None = None, max_kv_size: int | None = None
) -> LoadedModel:
    """Load a GGUF model; raises GGUFError with a one-line reason for a file gmlx cannot use.
    `max_kv_size` caps the context window the model serves (LoadedModel.context_length)."""
    step = progress or (lambda _: None)
    start = time.perf_counter()
    step("header")
    h = read_header(path)
    arch = architecture_for(h)
    mode = choose_mode(weights, h)
    if mode == "gguf" and (why := gguf_kernels_reason()) is not None:
        raise GGUFError(f"weights mode gguf is not available here: {why}")

    step("weights")
    arrays, quant, report = load_tensors(h, mode)  # type: ignore[arg-type]
    step("model")
    model = _build(arch, h, arrays, quant)
    del arrays  # the model holds the weights alone, so packing and in_huge_pages free each old buffer
    mx.eval(model.parameters())
    pack_weights(model)
    in_huge_pages(model)
    # Not beside the weights in a thread: tokenizers parses its JSON holding the GIL (measured: no gain).
    step("tokenizer")
    tokenizer = load_tokenizer(h)
    return LoadedModel(model, tokenizer, h, mode, report, time.perf_counter() - start, max_kv_size)


def _build(
    arch: Architecture, h: GGUFHeader, arrays: dict[str, mx.array], quant: dict[str, tuple[int, int]]
) -> nn.Module:
    module = importlib.import_module(arch.module)
    args = module.ModelArgs.from_dict(arch.model_args(h))
    model = module.Model(args)
    arch.prepare(model, h)

    weights: dict[str, mx.array] = {}
    configs: dict[str, dict] = {}
    blocks: dict[str, tuple[mx.array, int]] = {}  # gguf mode: module path -> (uint8 rows, GGML type)
    for name, array in arrays.items():
        base, _, suffix = name.rpartition(".")
        target = arch.mlx_name(base) if suffix in _SUFFIXES else None
        if target is None:
            continue  # e.g. rope_freqs: used by arch.finish, not a parameter
        if name in quant and quant[name][0] == GGUF_BLOCKS:
            weights[f"{target}.{suffix}"] = array
            blocks[target] = (array, quant[name][1])
            continue
        weights[f"{target}.{suffix}"] = arch.adjust(name, array)
        if name in quant:
            bits, group_size = quant[name]
            configs[target] = {"bits": bits, "group_size": group_size}

    if hasattr(model, "sanitize"):  # not every mlx_lm class has one (gemma2)
        weights = model.sanitize(weights)
    if configs:
        nn.quantize(model, class_predicate=lambda path, _: configs.get(path, False))
    if blocks:
        _use_gguf_blocks(model, use_gguf_experts(model, blocks))  # merged 3-D experts first
    _check_names(h, set(tree_flatten(model.parameters(), destination={})), set(weights))
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:  # a shape or type mismatch; MLX's message may span lines
        raise GGUFError(f"{h.architecture}: tensors do not match the model ({' '.join(str(e).split())})") from None
    arch.finish(model, h, arrays)
    fuse_attention(model)
    if blocks:
        from gmlx.kernels import fuse_mlps

        fuse_mlps(model)  # after the weights: it checks each fused MLP against the module's own output
    return model


def _check_names(h: GGUFHeader, expected: set[str], found: set[str]) -> None:
    """One line naming the first few parameters a file lacks or has extra (MLX lists them all, a line each)."""
    for what, names in (("missing", expected - found), ("unexpected", found - expected)):
        if names:
            shown = ", ".join(sorted(names)[:_NAMES_SHOWN])
            more = f" and {len(names) - _NAMES_SHOWN} more" if len(names) > _NAMES_SHOWN else ""
            raise GGUFError(
                f"{h.architecture}: tensors do not match the model: {len(names)} {what} "
                f"parameter(s): {shown}{more}: {h.path}"
            )


def _use_gguf_blocks(model: nn.Module, blocks: dict[str, tuple[mx.array, int]]) -> None:
    """Swap each nn.Linear / nn.Embedding whose weight stays in GGUF blocks for gmlx.kernels' layer."""
    from gmlx.kernels import GGUFEmbedding, GGUFLinear, group_linears

    swaps = []
    for path, module in model.named_modules():
        if path not in blocks:
            continue
        w, ggml_type = blocks[path]
        rows, k = module.weight.shape  # the float layer mlx_lm built: (out, in)
        if w.shape[0] != rows:
            raise GGUFError(f"{path}: {w.shape[0]} rows in the file, the model expects {rows}")
        if isinstance(module, nn.Embedding):
            swaps.append((path, GGUFEmbedding(w, ggml_type, k)))
        elif isinstance(module, nn.Linear):
            bias = mx.zeros((rows,), mx.float32) if "bias" in module else None  # loaded by load_weights
            swaps.append((path, GGUFLinear(w, ggml_type, k, bias=bias)))
        else:
            raise GGUFError(f"{path}: a {type(module).__name__} cannot take GGUF block weights")
    missing = set(blocks) - {p for p, _ in swaps}
    if missing:
        raise GGUFError(f"GGUF block weights for modules the model lacks: {', '.join(sorted(missing))}")
    model.update_modules(tree_unflatten(swaps))
    group_linears(model)
