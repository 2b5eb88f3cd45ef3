"""Mixture-of-experts specifics beyond the llama.cpp references (tests/test_architectures.py): the `gguf` mode
keeps the merged expert tensors in the file's blocks and multiplies them with gmlx.kernels, with the same
logits as the float model, in the memory the plan counts; a type the kernels lack falls back per projection;
served decoding (mlx_lm's BatchGenerator) gives the same tokens; deepseek2's latent cache is the size
gmlx.capacity plans for it."""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest
from conftest import kv_float_bytes
from gguf import GGMLQuantizationType as Q
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache
from tiny_moe import MLA, V3_LEGACY, write_deepseek2, write_moe

from gmlx import kernels
from gmlx.capacity.memory import KVFormat, kv_bytes
from gmlx.gguf.header import GGUFError, read_header
from gmlx.models.experts import GGUFSwitchGLU, GGUFSwitchLinear
from gmlx.models.loader import load
from gmlx.models.weights_mode import resident_bytes

needs_kernels = pytest.mark.skipif(kernels.reason() is not None, reason=f"gguf kernels unavailable: {kernels.reason()}")


def _logits(path: Path, mode: str) -> np.ndarray:
    """A batch of two 40-token prompts (many rows per expert), then one decode step through the cache."""
    model = load(path, mode).model  # type: ignore[arg-type]
    ids = mx.array(np.random.default_rng(1).integers(8, 250, (2, 40)))
    cache = make_prompt_cache(model)
    prefill = model(ids, cache=cache)
    step = model(mx.argmax(prefill[:, -1:], axis=-1), cache=cache)
    return np.concatenate([np.array(prefill), np.array(step)], axis=1)


def _write(path: Path, arch: str, qtype: Q = Q.Q8_0) -> Path:
    return write_deepseek2(path, qtype) if arch == "deepseek2" else write_moe(path, arch, qtype)


@needs_kernels
@pytest.mark.parametrize(
    "arch, qtype", [("qwen3moe", Q.Q8_0), ("qwen2moe", Q.Q8_0), ("qwen3moe", Q.Q4_0), ("deepseek2", Q.Q8_0)]
)
def test_gguf_mode_runs_experts_in_their_blocks(tmp_path: Path, arch: str, qtype: Q) -> None:
    path = _write(tmp_path / "m.gguf", arch, qtype)
    m = load(path, "gguf")
    glus = [layer.mlp.switch_mlp for layer in m.model.model.layers if "switch_mlp" in layer.mlp]
    assert glus and all(isinstance(g, GGUFSwitchGLU) and isinstance(g.down_proj, GGUFSwitchLinear) for g in glus)
    assert m.report.resident_bytes == resident_bytes(read_header(path), "gguf")  # what the plan counts
    assert m.report.resident_bytes < 0.4 * load(path, "float").report.resident_bytes
    # Float activations: with integer ones (every prompt row on AMX and on AVX-512 with VNNI) a router's
    # near-tie can send one token to another expert (seen: deepseek2 from its fifth token, 0.3 of the largest
    # logit; other prompts 8e-5), and the comparison would then say nothing about the blocks. The integer
    # path is checked against a float64 reference in tests/test_kernels.py.
    kernels.extension().set_act_bits(0)
    try:
        blocks = _logits(path, "gguf")
    finally:
        kernels.extension().set_act_bits(16)
    floats = _logits(path, "float")
    assert np.abs(blocks - floats).max() <= 5e-4 * np.abs(floats).max()


@needs_kernels
def test_a_type_without_kernels_falls_back_per_projection(tmp_path: Path) -> None:
    # llama.cpp's low-bit mixes: Q2_K/Q3_K gate and up (no gguf kernel: dequantized), a Q4_K down (blocks).
    path = write_moe(tmp_path / "m.gguf", "qwen3moe", expert_qtypes=(Q.Q2_K, Q.Q3_K, Q.Q4_K))
    glu = load(path, "gguf").model.model.layers[0].mlp.switch_mlp
    assert isinstance(glu, GGUFSwitchGLU)
    assert not isinstance(glu.gate_proj, GGUFSwitchLinear) and isinstance(glu.down_proj, GGUFSwitchLinear)
    blocks, floats = _logits(path, "gguf"), _logits(path, "float")
    # Random K-quant blocks use their whole code range: wider activations than above, which the kernels' 16-bit
    # activation codes round to ~8e-4 of the largest logit (5e-6 with GMLX_KERNELS_ACT_BITS=0, float activations).
    assert np.abs(blocks - floats).max() <= 2e-3 * np.abs(floats).max()


def _served_tokens(path: Path, mode: str) -> list[list[int]]:
    """Greedy tokens of three streams of different lengths decoding together, as the server runs them."""
    gen = BatchGenerator(load(path, mode).model, completion_batch_size=3, prefill_batch_size=3)  # type: ignore[arg-type]
    uids = gen.insert([list(range(8, 8 + n)) for n in (5, 23, 61)], [6] * 3)
    out: dict[int, list[int]] = {u: [] for u in uids}
    while any(len(t) < 6 for t in out.values()):
        for r in gen.next()[1]:
            out[r.uid].append(r.token)
    gen.close()
    return [out[u] for u in uids]


@needs_kernels
@pytest.mark.parametrize("arch", ["qwen3moe", "deepseek2"])
def test_served_streams_decode_alike_in_gguf_and_float_mode(tmp_path: Path, arch: str) -> None:
    path = _write(tmp_path / "m.gguf", arch)
    assert _served_tokens(path, "gguf") == _served_tokens(path, "float")


@pytest.mark.parametrize("z", [MLA(), V3_LEGACY], ids=["split", "legacy"])
def test_deepseek2_caches_the_latent_the_plan_counts(tmp_path: Path, z: MLA) -> None:
    # Both layouts cache the latent in gmlx (llama.cpp caches full keys and values for the legacy one).
    path = write_deepseek2(tmp_path / "m.gguf", z=z)
    m = load(path, "float")
    cache = make_prompt_cache(m.model)
    depth = 300
    mx.eval(m.model(mx.array([list(range(8, 8 + depth))]) % 200, cache=cache))
    allocated = sum(c.keys.nbytes + c.values.nbytes for c in cache)
    g = m.geometry
    assert {(c.keys.shape[-1], c.values.shape[-1]) for c in cache} == {(g.kv_lora_rank, g.rope_dim)}
    # float16 where the kernels run attention, whole steps of 256
    assert allocated == kv_bytes(g, depth, KVFormat(float_bytes=kv_float_bytes()), allocated=True)


def _header_only(path: Path, arch: str, tensors: dict[str, tuple[int, ...]], **keys: int) -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_embedding_length(64)
    w.add_head_count(1)
    for key, value in keys.items():
        w.add_uint32(f"{arch}.{key}", value)
    for name, shape in tensors.items():
        w.add_tensor(name, np.zeros(shape, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize(
    "arch, tensors, keys, message",
    [
        (
            "deepseek2",
            {"token_embd.weight": (4, 64), "blk.0.attn_k_b.weight": (2, 8, 16)},
            {"expert_count": 4},
            "deepseek2: deepseek2.rope.dimension_count is missing",
        ),
        (
            "qwen2moe",
            {"token_embd.weight": (4, 64)},
            {"expert_count": 4, "expert_used_count": 2},
            "qwen2moe: no output.weight",
        ),
    ],
)
def test_a_file_gmlx_cannot_map_is_a_one_line_error(
    tmp_path: Path, arch: str, tensors: dict, keys: dict, message: str
) -> None:
    with pytest.raises(GGUFError, match=re.escape(message)) as e:
        load(_header_only(tmp_path / "m.gguf", arch, tensors, **keys), "float")
    assert "\n" not in str(e.value)
