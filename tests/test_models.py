"""Loading tiny GGUF models of every architecture and tensor type into mlx_lm."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest
import tiny_architectures as dense
from gguf import GGMLQuantizationType as Q
from tiny_models import ARCHES, write_model
from tiny_moe import write_deepseek2, write_moe
from typer.testing import CliRunner

from gmlx.cli.common import EXIT_BAD_MODEL
from gmlx.cli.main import app
from gmlx.gguf.header import GGUFError, read_header
from gmlx.models import SUPPORTED
from gmlx.models.export import export
from gmlx.models.loader import ARCHITECTURES, load

EXACT = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K]
REQUANTIZED = [Q.Q6_K, Q.Q3_K, Q.Q2_K]
PROMPT = [2, 10, 20, 30, 40, 50]


def logits(path: Path, weights: str) -> np.ndarray:
    m = load(path, weights)  # type: ignore[arg-type]
    out = m.model(mx.array([PROMPT]))
    return np.array(out[0].astype(mx.float32))


@pytest.mark.parametrize("arch", ARCHES)
def test_every_architecture_loads_and_generates(tiny_models: dict[str, Path], arch: str) -> None:
    m = load(tiny_models[arch], "float")
    assert m.model_id == f"tiny-{arch}" and m.mode == "float"
    out = m.model(mx.array([PROMPT]))
    assert out.shape == (1, len(PROMPT), m.geometry.vocab_size)
    assert bool(mx.all(mx.isfinite(out)))
    # native mode on F32 weights is the same model
    np.testing.assert_allclose(logits(tiny_models[arch], "native"), np.array(out[0]), rtol=1e-4, atol=1e-4)


def test_gemma_norms_lose_the_stored_plus_one(tiny_models: dict[str, Path]) -> None:
    h = read_header(tiny_models["gemma3"])
    stored = np.frombuffer(
        h._buffer(),
        np.float32,
        count=h.tensors["output_norm.weight"].n_elements,
        offset=h.tensors["output_norm.weight"].offset,
    )
    m = load(tiny_models["gemma3"], "float")
    np.testing.assert_allclose(np.array(m.model.model.norm.weight), stored - 1.0, atol=1e-6)
    args = m.model.args
    assert (args.sliding_window, args.sliding_window_pattern, args.query_pre_attn_scalar) == (64, 6, 64)
    assert args.rope_local_base_freq == 10000.0


@pytest.mark.parametrize("arch", ARCHES)
def test_layers_in_fewer_nodes_give_mlx_lms_floats(tiny_models: dict[str, Path], arch: str) -> None:
    # Where the kernels run, a decode step's attention layers split their heads in fused nodes
    # (fast.heads) and Gemma 3's blocks add their residuals with the norms about them
    # (fast.add_norm): the logits must be those of mlx_lm's own layers to the bit, in batched decode
    # steps (per-row offsets) after prompts past Gemma 3's sliding window (a rotated cache). Both
    # store the KV cache as float16.
    from mlx_lm.models.cache import make_prompt_cache

    from gmlx import kernels
    from gmlx.kernels import fast
    from gmlx.models.fused import FusedAttention, HalfStore
    from gmlx.models.gemma3 import Gemma3Block

    if not (kernels.available() and fast.installed()):
        pytest.skip("the fused layers run only with gmlx's CPU kernels")
    m = load(tiny_models[arch], "gguf")
    blocks = m.model.model.layers
    assert all(isinstance(b.self_attn, FusedAttention) for b in blocks)
    assert all(isinstance(b, Gemma3Block) for b in blocks) == (arch == "gemma3")

    def run() -> list[np.ndarray]:
        # two prompts, prefilled apart, then decoded together in mlx_lm's batch caches (merged:
        # left-padded rows, per-row offsets), as the engine runs them
        rng = np.random.default_rng(3)
        rows, outs = [], []
        for n in (90, 71):
            cache = make_prompt_cache(m.model)
            outs.append(m.model(mx.array(rng.integers(3, 200, (1, n))), cache=cache))
            rows.append(cache)
        batch = [c.merge([row[i] for row in rows]) for i, c in enumerate(rows[0])]
        assert all(isinstance(c.offset, mx.array) and c.offset.shape == (2,) for c in batch)
        y = mx.concatenate([mx.argmax(o[:, -1], axis=-1) for o in outs])[:, None]
        for _ in range(4):
            outs.append(m.model(y, cache=batch))
            y = mx.argmax(outs[-1][:, -1], axis=-1)[:, None]
        assert {c.keys.dtype for c in batch} == {mx.float16}
        return [np.array(o) for o in outs]

    fused = run()
    for b in blocks:  # back to mlx_lm's own classes (with the float16 store), the parameters unchanged
        own_class = type(b.self_attn).__bases__[-1]
        b.self_attn.__class__ = type(own_class.__name__, (HalfStore, own_class), {})
        if isinstance(b, Gemma3Block):
            b.__class__ = type(b).__bases__[0]
    own = run()
    assert all(np.array_equal(a, b) for a, b in zip(fused, own))


KV_STORE_SPECS = [dense.LLAMA3, dense.QWEN2, dense.QWEN3, dense.PHI3, dense.GEMMA2, dense.GEMMA3, dense.GRANITE]
KV_STORE_SPECS += [dense.OLMO2, dense.SMOLLM3]


@pytest.mark.parametrize(
    "write",
    [lambda p, s=s: dense.write(p, s) for s in KV_STORE_SPECS]
    + [lambda p, a=a: write_moe(p, a) for a in ("qwen2moe", "qwen3moe")]
    + [write_deepseek2],
    ids=[s.arch for s in KV_STORE_SPECS] + ["qwen2moe", "qwen3moe", "deepseek2"],
)
def test_every_architecture_stores_float16_kv_where_the_kernels_attend(tmp_path: Path, write, monkeypatch) -> None:
    # Every attention class gmlx loads takes the float16 store (gmlx.models.fused): a prompt and
    # two decode steps keep their caches in float16 and give the float32 store's logits but for
    # float16's rounding (the same tokens).
    from mlx_lm.models.cache import make_prompt_cache

    from gmlx.kernels import fast
    from gmlx.models import fused

    if not fast.installed():
        pytest.skip("the float16 store is where gmlx's kernels run attention")
    m = load(write(tmp_path / "m.gguf"), "float")

    def run() -> tuple[list[mx.array], set]:
        cache = make_prompt_cache(m.model)
        outs = [m.model(mx.array([PROMPT * 3]), cache=cache)[:, -1]]
        for token in (7, 11):
            outs.append(m.model(mx.array([[token]]), cache=cache)[:, -1])
        return outs, {c.keys.dtype for c in cache}

    half, dtypes = run()
    assert dtypes == {mx.float16}
    monkeypatch.setattr(fused, "KV_DTYPE", mx.float32)
    full, dtypes = run()
    assert dtypes == {mx.float32}
    for a, b in zip(half, full, strict=True):
        a, b = np.array(a), np.array(b)
        assert np.argmax(a) == np.argmax(b)
        np.testing.assert_allclose(a, b, atol=2e-2 * np.abs(b).max())


def test_llama_uses_interleaved_rope(tiny_models: dict[str, Path]) -> None:
    # llama.cpp's converter permutes Q/K for interleaved RoPE: `traditional` in MLX.
    m = load(tiny_models["llama"], "float")
    assert m.model.model.layers[0].self_attn.rope.traditional is True
    q = load(tiny_models["qwen3"], "float")
    assert q.model.model.layers[0].self_attn.rope.traditional is False


@pytest.mark.parametrize("tied", [True, False])
def test_tied_and_untied_embeddings(tmp_path: Path, tied: bool) -> None:
    path = write_model(tmp_path / "m.gguf", "qwen3", tied=tied)
    m = load(path, "native")
    assert m.model.args.tie_word_embeddings is tied
    assert ("lm_head" in dict(m.model.children())) is not tied


@pytest.mark.parametrize("qtype", EXACT, ids=lambda q: q.name)
def test_exact_formats_native_matches_float(tmp_path: Path, qtype: Q) -> None:
    """Native repacks compute the model that float dequantization does, up to matmul rounding."""
    path = write_model(tmp_path / f"{qtype.name}.gguf", "llama", qtype=qtype)
    native, floats = logits(path, "native"), logits(path, "float")
    assert np.abs(native - floats).max() <= 2e-3 * np.abs(floats).max()
    assert (native.argmax(-1) == floats.argmax(-1)).all()


@pytest.mark.parametrize("qtype", REQUANTIZED, ids=lambda q: q.name)
def test_sixteen_wide_formats_are_requantized_and_reported(tmp_path: Path, qtype: Q) -> None:
    # Accuracy per group is checked in test_tensors; random blocks make model-level logits meaningless.
    m = load(write_model(tmp_path / f"{qtype.name}.gguf", "llama", qtype=qtype), "native")
    assert m.report.by_type[qtype.name]["action"].startswith("re-quantized")
    assert bool(mx.all(mx.isfinite(m.model(mx.array([PROMPT])))))


def test_unknown_architecture_is_a_clear_error(tmp_path: Path) -> None:
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "mamba")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match="unsupported architecture 'mamba'"):
        load(tmp_path / "m.gguf")
    r = CliRunner().invoke(app, ["inspect", str(tmp_path / "m.gguf")])  # header-only commands refuse it too
    assert r.exit_code == EXIT_BAD_MODEL and r.stderr.strip().splitlines() == [
        f"error: unsupported architecture 'mamba' (supported: {', '.join(SUPPORTED)})"
    ]


@pytest.mark.parametrize(
    ("spec", "extra", "message"),
    [
        (dense.PHI3, lambda t: t.vector("rope_factors_long.weight", 32), "phi3: LongRoPE (rope_factors_long) is not"),
        (
            dense.OLMO2,
            lambda t: t.w.add_uint32("olmo2.attention.sliding_window", 32),
            "olmo2: a sliding window (Olmo 3)",
        ),
    ],
    ids=["phi3-longrope", "olmo3"],
)
def test_unmapped_variants_are_refused_in_one_line(tmp_path: Path, spec: dense.Spec, extra, message: str) -> None:
    path = dense.write(tmp_path / "m.gguf", spec, extra=extra)
    with pytest.raises(GGUFError) as e:
        load(path, "float")
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "spec",
    [dense.PHI3, dataclasses.replace(dense.MISTRAL, keys={"attention.sliding_window": 32})],
    ids=["phi3", "mistral-v0.1"],
)
def test_a_window_llama_cpp_ignores_is_ignored(tmp_path: Path, spec: dense.Spec) -> None:
    # Phi-3's converter writes a sliding_window, and a llama file may carry Mistral v0.1's; llama.cpp and
    # mlx_lm attend to the whole context there, so the capacity model must count a full-length KV cache.
    h = read_header(dense.write(tmp_path / "m.gguf", spec))
    assert h.arch_key("attention.sliding_window") == 32
    assert h.geometry.sliding_window is None and not any(h.geometry.sliding_layers)


@pytest.mark.parametrize(
    ("spec", "why"),
    [(dense.GRANITE, "rotate-half RoPE"), (dense.GEMMA2, "no sliding window"), (dense.LLAMA3, "rope_freqs")],
    ids=["granite", "gemma2", "llama3"],
)
def test_export_refuses_what_mlx_lm_would_rebuild_wrong(tmp_path: Path, spec: dense.Spec, why: str) -> None:
    path = dense.write(tmp_path / "m.gguf", spec)
    with pytest.raises(GGUFError, match=why):
        export(path, tmp_path / "out")


def test_supported_names_are_the_loaders() -> None:
    assert sorted(ARCHITECTURES) == list(SUPPORTED)


def test_missing_tensor_is_a_clear_error(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    src = read_header(tiny_models["llama"])
    w = gguf.GGUFWriter(str(tmp_path / "broken.gguf"), "llama")
    for key in (
        "block_count",
        "context_length",
        "embedding_length",
        "feed_forward_length",
        "attention.head_count",
        "attention.head_count_kv",
        "attention.layer_norm_rms_epsilon",
    ):
        value = src.arch_key(key)
        (w.add_float32 if isinstance(value, float) else w.add_uint32)(f"llama.{key}", value)
    w.add_tensor("token_embd.weight", np.zeros((8, 256), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError) as e:
        load(tmp_path / "broken.gguf")
    message = str(e.value)
    assert "\n" not in message
    # Two layers of 9 weights and the final norm are missing; three are named, then a count.
    assert "tensors do not match the model: 19 missing parameter(s): model.layers.0." in message
    assert message.endswith(f" and 16 more: {tmp_path / 'broken.gguf'}")


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["float", "native"])
def test_default_model_writes_about_the_sea(default_model: Path, weights: str) -> None:
    from mlx_lm import generate

    m = load(default_model, weights)  # type: ignore[arg-type]
    prompt = m.tokenizer.encode("Here is a short poem about the sea:\n")
    text = generate(m.model, m.tokenizer, prompt, max_tokens=8)
    assert text.startswith("The sea is a beautiful place"), text
