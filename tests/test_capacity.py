"""The capacity arithmetic against hand-computed cases: no MLX, no model files."""

from __future__ import annotations

import dataclasses
import sys

import pytest

from gmlx.capacity.budget import (
    HOST_BYTES_ESTIMATE,
    GovernorTerms,
    MemoryBudget,
    parse_bytes,
    prefill_working_bytes,
)
from gmlx.capacity.estimate import PrefillFit, estimate, fit_prefill
from gmlx.capacity.memory import (
    FP16,
    FP32,
    KVFormat,
    LayerKind,
    kv_bytes,
    kv_bytes_per_token,
    kv_layer_kinds,
    layer_bytes_per_token,
    outgrown_bytes,
    rotating_prefill_bytes,
    sliding_prefill_bytes,
    store_cast_bytes,
    stream_bytes,
    warmup_per_token,
)
from gmlx.capacity.plan import LiveState, plan
from gmlx.capacity.table import (
    CapacityTable,
    build_table,
    capacity_table,
    depth_grid,
    governor_terms,
    prefill_bytes,
    prefill_growth,
)
from gmlx.gguf.header import ModelGeometry

KiB, MiB, GiB = 2**10, 2**20, 2**30


def geometry(n_layers: int = 32, n_kv: int | tuple[int, ...] = 8, head: int = 128, **kw) -> ModelGeometry:
    fields = {
        "architecture": "llama",
        "name": "test",
        "n_layers": n_layers,
        "n_embd": 4096,
        "n_ff": 14336,
        "n_heads": 32,
        "n_kv_heads": n_kv if isinstance(n_kv, tuple) else (n_kv,) * n_layers,
        "key_length": head,
        "value_length": head,
        "context_length": 131072,
        "vocab_size": 128256,
        "sliding_window": None,
        "sliding_layers": (False,) * n_layers,
        "rope_theta": 500000.0,
        "norm_eps": 1e-5,
        "kv_lora_rank": None,
        "q_lora_rank": None,
        "n_experts": None,
        "n_params": 0,
        "weight_bytes": 0,
        "file_bytes": 0,
        "tensor_types": {},
        "has_chat_template": False,
    }
    return ModelGeometry(**{**fields, **kw})


LLAMA = geometry()  # 32 layers, 8 KV heads of 128
GEMMA3 = geometry(
    18,
    1,
    256,
    architecture="gemma3",
    n_embd=640,
    n_ff=2048,
    n_heads=4,
    context_length=32768,
    vocab_size=262144,
    sliding_window=512,
    sliding_layers=tuple((i + 1) % 6 != 0 for i in range(18)),
)
MLA = geometry(4, 16, 192, value_length=128, architecture="deepseek2", kv_lora_rank=512, q_lora_rank=1536, rope_dim=64)
Q8 = KVFormat(bits=8, group_size=64)

# Per-token bytes, by hand.
LLAMA_TOKEN = 32 * 8 * (128 + 128) * 2  # layers x KV heads x (K + V widths) x fp16 = 131072
GEMMA_FULL_TOKEN = 3 * 1 * (256 + 256) * 2  # layers 6, 12, 18 are global: 3072
GEMMA_SLIDING_TOKEN = 15 * 1 * (256 + 256) * 2  # the other 15 keep 512 tokens: 15360


# ---- memory ----------------------------------------------------------------------------------


def test_dense_llama_kv_bytes() -> None:
    assert LLAMA_TOKEN == 131072
    assert layer_bytes_per_token(LLAMA, 0) == 8 * 256 * 2
    assert kv_bytes(LLAMA, 1000) == 1000 * 131072
    assert kv_bytes(LLAMA, 0) == 0


def test_grouped_kv_heads_per_layer() -> None:
    g = geometry(4, (2, 2, 4, 8), 64, n_heads=16)
    assert [layer_bytes_per_token(g, i) for i in range(4)] == [2 * 128 * 2, 2 * 128 * 2, 4 * 128 * 2, 8 * 128 * 2]
    assert kv_bytes(g, 100) == (2 + 2 + 4 + 8) * 128 * 2 * 100


def test_gemma3_sliding_and_global_layers() -> None:
    assert kv_layer_kinds(GEMMA3) == [
        LayerKind("full", 3, GEMMA_FULL_TOKEN, None),
        LayerKind("sliding", 15, GEMMA_SLIDING_TOKEN, 512),
    ]
    # Under the window every layer holds every token; past it the sliding layers stop at 512.
    assert kv_bytes(GEMMA3, 300) == (3072 + 15360) * 300
    assert kv_bytes(GEMMA3, 2048) == 3072 * 2048 + 15360 * 512 == 14155776


def test_allocation_rounds_to_steps_of_256() -> None:
    assert kv_bytes(LLAMA, 1000, allocated=True) == 1024 * LLAMA_TOKEN
    assert kv_bytes(LLAMA, 1024, allocated=True) == 1024 * LLAMA_TOKEN
    assert kv_bytes(LLAMA, 1025, allocated=True) == 1280 * LLAMA_TOKEN
    # Sliding layers grow in the same steps but never past the window.
    assert kv_bytes(GEMMA3, 300, allocated=True) == (3072 + 15360) * 512
    assert kv_bytes(GEMMA3, 2049, allocated=True) == 3072 * 2304 + 15360 * 512


def test_mla_caches_latent_plus_rope_key() -> None:
    # One latent of 512 plus a rotary key of 64 per token and layer; heads and V width do not count.
    assert layer_bytes_per_token(MLA, 0) == (512 + 64) * 2
    assert kv_bytes(MLA, 10) == 4 * 576 * 2 * 10


def test_quantized_kv_format() -> None:
    # 8 bits per element, plus an fp16 scale and bias per 64 elements: 128 wide -> 128 + 2 x 4 bytes.
    assert Q8.element_bytes() == 1 + 4 / 64
    assert 128 * Q8.element_bytes() == 128 + 2 * (2 + 2)
    assert kv_bytes(LLAMA, 1000, Q8) == 32 * 8 * 2 * 136 * 1000
    assert KVFormat(bits=4, group_size=32, float_bytes=4).element_bytes() == 0.5 + 8 / 32
    assert FP16.element_bytes() == 2 and FP32.element_bytes() == 4
    assert kv_bytes(LLAMA, 10, FP32) == 2 * kv_bytes(LLAMA, 10)
    assert (FP16.describe(), FP32.describe(), Q8.describe()) == ("fp16", "fp32", "8-bit g64, fp16 scales")
    with pytest.raises(ValueError, match="bits"):
        KVFormat(bits=5)


def test_warmup_per_token_figures() -> None:
    assert kv_bytes_per_token(LLAMA) == LLAMA_TOKEN and kv_bytes_per_token(GEMMA3) == 3072 + 15360
    # Dense: 32 prompt tokens sit in one 256-token step, so the measured bytes are over 256 slots.
    exact = warmup_per_token(LLAMA, 32, 256 * LLAMA_TOKEN)
    assert exact == {"kv_bytes_per_token_predicted": LLAMA_TOKEN, "kv_bytes_per_token_measured": LLAMA_TOKEN}
    assert warmup_per_token(LLAMA, 32, 256 * LLAMA_TOKEN * 11 // 10)["kv_bytes_per_token_measured"] == pytest.approx(
        1.1 * LLAMA_TOKEN
    )
    # gemma3 right after 32 prompt tokens: global layers hold 256 slots, sliding ones exactly 32.
    held = 3072 * 256 + 15360 * 32
    assert warmup_per_token(GEMMA3, 32, held)["kv_bytes_per_token_measured"] == 3072 + 15360
    assert warmup_per_token(GEMMA3, 32, 2 * held)["kv_bytes_per_token_measured"] == 2 * (3072 + 15360)


def test_kv_quant_plans_with_the_window_in_use() -> None:
    """The kvarn tail is judged against the window served: a max_kv_size below the GGUF's window
    can make it cover everything, one above it cannot stretch the window."""
    from gmlx.capacity.kv_quant import DROPPED, KVQuantSettings, plan_kv_quant

    kvarn = KVQuantSettings(bits=8, scheme="kvarn", tail_tokens=1024)
    assert plan_kv_quant(kvarn, LLAMA).verdict != DROPPED
    capped = plan_kv_quant(kvarn, LLAMA, context_length=1024)
    assert capped.verdict == DROPPED and "whole 1024-token context" in capped.reason
    small = dataclasses.replace(LLAMA, context_length=512)
    assert "whole 512-token context" in plan_kv_quant(kvarn, small, context_length=10**6).reason


def test_prefill_attention_in_tiles_follows_the_kv_plan() -> None:
    """A uniform cache exposes `bits`, so mlx_lm attends over it through its quantized matmuls,
    which hold a layer's whole scores: the plan counts them even where gmlx's kernels would tile."""
    from gmlx.capacity.kv_quant import KVQuantSettings, plan_kv_quant
    from gmlx.capacity.table import attention_in_tiles

    uniform = plan_kv_quant(KVQuantSettings(bits=8, scheme="uniform"), LLAMA)
    kvarn = plan_kv_quant(KVQuantSettings(bits=8, scheme="kvarn", tail_tokens=128), LLAMA)
    assert attention_in_tiles(True, None) and attention_in_tiles(True, kvarn)
    assert not attention_in_tiles(True, uniform) and not attention_in_tiles(False, None)


def test_capacity_imports_no_mlx() -> None:
    import subprocess

    code = "import sys, gmlx.capacity.plan, gmlx.capacity.estimate; print('mlx' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


# ---- budget ----------------------------------------------------------------------------------


def test_budget_reserve_and_kv() -> None:
    b = MemoryBudget(total_bytes=16 * GiB, weight_bytes=4 * GiB, prefill_bytes=1 * GiB)
    assert b.reserve_bytes == int(0.1 * 16 * GiB)  # the fraction beats the 512 MiB floor
    assert b.kv_bytes == 16 * GiB - 4 * GiB - 1 * GiB - int(0.1 * 16 * GiB)
    small = MemoryBudget(total_bytes=2 * GiB, weight_bytes=1 * GiB, prefill_bytes=256 * MiB)
    assert small.reserve_bytes == 512 * MiB  # 10% would be 205 MiB: the floor wins
    assert small.kv_bytes == 256 * MiB
    assert MemoryBudget(total_bytes=GiB, weight_bytes=GiB, prefill_bytes=0).kv_bytes == 0  # never negative


def test_drained_and_free_now_leave_the_prompt_cache_bound() -> None:
    b = MemoryBudget(total_bytes=16 * GiB, weight_bytes=4 * GiB, prefill_bytes=1 * GiB, prompt_cache_bytes=2 * GiB)
    assert b.drained_bytes == 16 * GiB - 4 * GiB - b.reserve_bytes - 2 * GiB
    # A request fits once drained exactly when its stream fits the KV budget (both leave the bound out).
    assert b.drained_bytes - b.prefill_bytes == b.kv_bytes
    # Idle, with the weights and 512 MiB of cached prompts resident: the cache's unused bound stays off too.
    assert b.free_now_bytes(4 * GiB + 512 * MiB, 512 * MiB) == b.drained_bytes
    # Entries past the bound (before an eviction) do not count as room.
    assert b.free_now_bytes(4 * GiB + 3 * GiB, 3 * GiB) == b.drained_bytes - GiB
    assert b.free_now_bytes(10 * GiB, 0) == b.drained_bytes - 6 * GiB  # 6 GiB of running streams


def test_prefill_working_bytes() -> None:
    chunk, context = 512, 32768
    hidden = chunk * (640 * 4 + 2048 * 3)
    scores = 4 * chunk * context  # heads x chunk x keys: a global layer sees the whole window
    assert prefill_working_bytes(GEMMA3, chunk, context) == 4 * (hidden + scores + 262144)
    # A chunk longer than the context is cut to it.
    assert prefill_working_bytes(GEMMA3, 4096, 100) == 4 * (100 * 8704 + 4 * 100 * 100 + 262144)
    # When every layer slides, keys stop at window - 1 + chunk.
    mistral = dataclasses.replace(LLAMA, sliding_window=4096, sliding_layers=(True,) * 32)
    expected = 4 * (512 * (4096 * 4 + 14336 * 3) + 32 * 512 * (4096 - 1 + 512) + 128256)
    assert prefill_working_bytes(mistral, 512, 32768) == expected
    # gmlx's CPU kernels attend over tiles of keys: no layer's scores are ever whole
    assert prefill_working_bytes(GEMMA3, chunk, context, tiled_attention=True) == 4 * (hidden + 262144)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("64GiB", 64 * GiB),
        ("512MiB", 512 * MiB),
        ("8GB", 8 * 10**9),
        ("1.5G", 3 * GiB // 2),
        ("1048576", MiB),
        (" 2 gi ", 2 * GiB),
        ("4k", 4 * KiB),
        ("100B", 100),
        ("99999999999999999999", 99999999999999999999),
    ],
)
def test_parse_bytes(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "-1G", "12Q", "1.2.3G", "ten"])
def test_parse_bytes_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="not a memory size"):
        parse_bytes(text)


# ---- table -----------------------------------------------------------------------------------

# 2 layers x 1 KV head x (64 + 64) x fp16 = 512 bytes a token, so 256 tokens take 128 KiB.
# A decoding stream also holds 2 logits rows: 2 x 64 (vocabulary) x float32 = 512 bytes. The
# budget is 1 MiB of KV plus that overhead for 8 streams, so one stream holds 2048 tokens.
SMALL = geometry(2, 1, 64, context_length=4096, vocab_size=64)
OVERHEAD = 2 * 64 * 4
ONE_MIB = MemoryBudget(
    total_bytes=MiB + 8 * OVERHEAD, weight_bytes=0, prefill_bytes=0, reserve_floor_bytes=0, reserve_fraction=0
)


def small_table(**kw) -> CapacityTable:
    return build_table(SMALL, ONE_MIB, 8, **kw)


def test_table_small_hand_case() -> None:
    t = small_table()
    # (budget / width - overhead), rounded down to whole 256-token steps of 128 KiB.
    assert t.widths() == {1: 2048, 2: 1024, 3: 512, 4: 512, 5: 256, 6: 256, 7: 256, 8: 256}
    assert t.max_context_at_width(9) == 0  # 9 x (128 KiB + overhead) > the budget
    assert t.depths() == {512: 4, 1024: 2, 2048: 1, 4096: 0}
    assert t.max_width_at_depth(1) == 8  # 1 MiB / 128 KiB = 8: the decode batch caps it anyway
    assert t.max_width_at_depth(4097) == 0  # past the window
    assert t.headline() == "capacity: 8 streams of 256 tokens, or 1 stream of 2048"
    j = t.to_json()
    assert j["widths"]["1"] == 2048 and j["depths"]["4096"] == 0 and j["budget"]["kv_bytes"] == MiB + 8 * OVERHEAD
    assert j["kv_format"]["describe"] == "fp16" and j["headline"] == t.headline()


def test_table_capped_by_window() -> None:
    t = small_table(context_length=1024)
    assert t.context_length == 1024 and t.max_context_at_width(1) == 1024
    assert t.headline() == "capacity: 8 streams of 256 tokens, or 1 stream of 1024"
    assert small_table(context_length=10**6).context_length == 4096  # max_kv_size never widens the GGUF's
    assert build_table(SMALL, ONE_MIB, 1).headline() == "capacity: 1 stream of 2048 tokens"
    empty = dataclasses.replace(ONE_MIB, total_bytes=0)
    assert build_table(SMALL, empty, 8).max_context_at_width(1) == 0
    assert build_table(SMALL, empty, 8).headline().startswith("capacity: no room")


def test_table_monotonic_on_a_real_shape() -> None:
    b = MemoryBudget(total_bytes=64 * GiB, weight_bytes=16 * GiB, prefill_bytes=GiB)
    t = build_table(LLAMA, b, 16)
    widths = list(t.widths().values())
    assert widths == sorted(widths, reverse=True) and widths[0] > 0
    depths = list(t.depths().values())
    assert depths == sorted(depths, reverse=True)
    assert list(t.depths()) == [512 * 2**i for i in range(9)]  # 512 .. 131072
    for w, d in t.widths().items():  # each answer fits, with a prefill chunk a stream, and one step more does not
        assert w * (stream_bytes(LLAMA, d) + GiB) <= b.drained_bytes
        assert d == LLAMA.context_length or w * (stream_bytes(LLAMA, d + 1) + GiB) > b.drained_bytes


def test_capacity_table_composes_budget_and_table() -> None:
    t = capacity_table(
        GEMMA3,
        weight_bytes=GiB,
        decode_batch=4,
        prefill_step=512,
        memory=8 * GiB,
        kv=FP32,
        reserve_fraction=0.2,
        reserve_floor=0,
        context_length=8192,
    )
    # The chunk sees the server's window, not the GGUF's, and grows the sliding caches.
    # Once per batch, MLX's buffer cache holds about one stream's replaced sliding buffers more.
    transient = rotating_prefill_bytes(GEMMA3, 512, FP32)
    prefill = prefill_working_bytes(GEMMA3, 512, 8192) + sliding_prefill_bytes(GEMMA3, 512, FP32)
    assert t.budget == MemoryBudget(8 * GiB, GiB, prefill, 0, 0.2, batch_bytes=transient)
    assert t.budget.kv_bytes == 8 * GiB - GiB - int(0.2 * 8 * GiB) - prefill - transient
    assert (t.context_length, t.decode_batch, t.kv, t.prefill_step) == (8192, 4, FP32, 512)


def test_streams_arriving_together_each_bring_a_chunk_and_what_their_caches_outgrew() -> None:
    t = capacity_table(
        GEMMA3,
        weight_bytes=GiB,
        decode_batch=8,
        prefill_step=512,
        memory=8 * GiB,
        kv=FP32,
        reserve_fraction=0.2,
        reserve_floor=0,
        context_length=8192,
    )
    # The full-attention layers' buffers before the last 512-token chunk of 2000 tokens: 1536 slots.
    # Each stream holds the one of the layer running its chunk; MLX's cache, once, every layer's.
    outgrown = outgrown_bytes(GEMMA3, 2000, 512, FP32)
    full = [k for k in kv_layer_kinds(GEMMA3, FP32) if k.window is None]
    assert outgrown == sum(k.bytes_per_token for k in full) * 1536 > 0
    layer = outgrown_bytes(GEMMA3, 2000, 512, FP32, one_layer=True)
    assert layer == outgrown // 3  # gemma3's 18 layers: 3 of full attention
    per_stream = t.stream_bytes(2000) + t.budget.prefill_bytes + layer
    for width in (1, 4, 8):
        assert t.streams_bytes(width, 2000) == width * per_stream + t.budget.batch_bytes + outgrown
    # A prompt no longer than a chunk outgrows nothing.
    assert outgrown_bytes(GEMMA3, 512, 512, FP32) == 0


def test_rotating_caches_while_a_chunk_runs() -> None:
    # Each sliding layer concatenates the chunk to the 511 tokens it keeps; full layers add nothing.
    assert rotating_prefill_bytes(GEMMA3, 512) == GEMMA_SLIDING_TOKEN * (512 - 1 + 512)
    assert rotating_prefill_bytes(GEMMA3, 512, FP32) == 2 * GEMMA_SLIDING_TOKEN * 1023
    assert rotating_prefill_bytes(LLAMA, 512) == 0
    # A stream holds each sliding layer's chunk beyond its window, and one layer's buffer from before.
    layer = GEMMA_SLIDING_TOKEN / 15  # gemma3's 18 layers: 15 slide
    assert sliding_prefill_bytes(GEMMA3, 512) == round(GEMMA_SLIDING_TOKEN * 511 + layer * 1023)
    assert sliding_prefill_bytes(LLAMA, 512) == 0


def test_a_float16_store_counts_the_chunks_keys_and_values_cast() -> None:
    # One layer's keys and values of the chunk at a time, at the store's width; nothing cast into float32.
    assert store_cast_bytes(GEMMA3, 512) == 512 * (256 + 256) * 2
    assert store_cast_bytes(GEMMA3, 512, KVFormat(bits=4, float_bytes=2)) == store_cast_bytes(GEMMA3, 512)
    assert store_cast_bytes(GEMMA3, 512, FP32) == 0
    t = capacity_table(GEMMA3, weight_bytes=GiB, decode_batch=4, prefill_step=512, memory=8 * GiB, kv=FP16)
    assert t.budget.prefill_bytes == prefill_working_bytes(GEMMA3, 512, 32768) + sliding_prefill_bytes(
        GEMMA3, 512
    ) + store_cast_bytes(GEMMA3, 512)


def test_a_warm_up_that_measures_more_per_chunk_token_than_derived_raises_the_set_aside() -> None:
    # The warm-up's prefills of 32 and 64 tokens: the peaks' difference per token against the
    # derivation's, the set-aside raised by the excess for each token of a chunk.
    derived = (prefill_bytes(GEMMA3, 64, 64, FP16, True) - prefill_bytes(GEMMA3, 32, 32, FP16, True)) / 32
    more = prefill_growth(GEMMA3, FP16, True, 32, 3 * MiB, 3 * MiB + round(32 * (derived + 10_000)))
    assert more.predicted == derived and more.unplanned == pytest.approx(10_000)
    assert more.to_json() == {
        "prefill_bytes_per_token_predicted": round(derived, 1),
        "prefill_bytes_per_token_measured": round(derived + 10_000, 1),
        "prefill_scratch_bytes_per_token_measured": 0.0,
    }
    table = dict(weight_bytes=GiB, decode_batch=8, prefill_step=512, memory=2 * GiB, tiled_attention=True)
    plain, raised = capacity_table(GEMMA3, **table), capacity_table(GEMMA3, **table, growth=more)
    assert plain.budget.prefill_bytes == prefill_bytes(GEMMA3, 512, 32768, FP16, True)
    assert raised.budget.prefill_bytes == pytest.approx(plain.budget.prefill_bytes + 512 * 10_000, abs=1)
    assert raised.max_context_at_width(8) < plain.max_context_at_width(8)
    # Blocks that hold less than derived keep the derivation: the fan-out's peak was measured against it.
    less = prefill_growth(GEMMA3, FP16, True, 32, 3 * MiB, 3 * MiB + round(32 * derived / 2))
    assert less.unplanned == 0 and capacity_table(GEMMA3, **table, growth=less).budget == plain.budget
    # The longer prefill peaking lower is noise (a tiny model's), no measure: null, not a negative figure.
    noise = prefill_growth(GEMMA3, FP16, True, 32, 3 * MiB, 2 * MiB)
    assert noise.to_json()["prefill_bytes_per_token_measured"] is None and noise.unplanned == 0
    assert warmup_per_token(GEMMA3, 32, None)["kv_bytes_per_token_measured"] is None


def test_the_kernels_scratch_the_warm_up_measured_is_set_aside_once_a_batch() -> None:
    # The longer warm-up prefill (64 tokens) needed 2.25 MiB of the CPU kernels' scratch: one
    # stream's chunk of it beside the batch, not one a stream (docs/ARCHITECTURE.md, decision 39).
    plain = prefill_growth(GEMMA3, FP16, True, 32, 3 * MiB, 5 * MiB)
    scratch = prefill_growth(GEMMA3, FP16, True, 32, 3 * MiB, 5 * MiB, scratch_bytes=64 * 36_000)
    assert scratch.scratch == 36_000 and scratch.to_json()["prefill_scratch_bytes_per_token_measured"] == 36_000
    table = dict(weight_bytes=GiB, decode_batch=8, prefill_step=512, memory=2 * GiB, tiled_attention=True)
    without, counted = capacity_table(GEMMA3, **table, growth=plain), capacity_table(GEMMA3, **table, growth=scratch)
    assert counted.budget.batch_bytes == without.budget.batch_bytes + 512 * 36_000
    assert counted.budget.prefill_bytes == without.budget.prefill_bytes
    assert counted.streams_bytes(8, 2000) - without.streams_bytes(8, 2000) == 512 * 36_000
    assert counted.max_context_at_width(8) < without.max_context_at_width(8)


def test_the_budget_counts_what_the_governor_counts() -> None:
    """With a governor, the table leaves out the process's memory outside MLX and fills up to
    where orange starts; the prefill terms are those of a table without one."""
    kw = {
        "weight_bytes": 512 * MiB,
        "decode_batch": 4,
        "prefill_step": 512,
        "memory": 3 * GiB,
        "kv": FP32,
        "prompt_cache_bytes": 256 * MiB,
        "tiled_attention": True,
    }
    plain, governed = (
        capacity_table(GEMMA3, **kw),
        capacity_table(GEMMA3, **kw, governor=GovernorTerms(host_bytes=480 * MiB, ceiling=0.9)),
    )
    b = governed.budget
    assert (b.host_bytes, b.ceiling) == (480 * MiB, 0.9)
    assert (b.prefill_bytes, b.batch_bytes) == (plain.budget.prefill_bytes, plain.budget.batch_bytes)
    assert b.usable_bytes == 3 * GiB - b.reserve_bytes
    assert b.drained_bytes == int(0.9 * b.usable_bytes) - 512 * MiB - 480 * MiB - 256 * MiB
    assert b.kv_bytes == b.drained_bytes - b.prefill_bytes - b.batch_bytes
    assert 0 < governed.max_context_at_width(4) < plain.max_context_at_width(4)
    assert governed.to_json()["budget"]["host_bytes"] == 480 * MiB


class _Settings:
    def __init__(self, governor: bool) -> None:
        self.governor, self.governor_orange, self.governor_hysteresis = governor, 0.85, 0.05


def test_governor_terms_follow_the_governor() -> None:
    assert governor_terms(_Settings(False), 480 * MiB, host_memory=True) is None  # nothing counts RSS
    # The table fills up to orange less the hysteresis, so the noise of the process's memory
    # outside MLX does not tip a planned load into orange.
    assert governor_terms(_Settings(True), 480 * MiB, host_memory=True) == GovernorTerms(480 * MiB, 0.8)
    # On CUDA the governor reads the device's memory, not the process's: no host memory comes off.
    assert governor_terms(_Settings(True), 480 * MiB, host_memory=False) == GovernorTerms(0, 0.8)
    assert HOST_BYTES_ESTIMATE == 512 * MiB  # what `gmlx plan` assumes offline


def test_each_stream_brings_its_prefill() -> None:
    """A fan-out's streams arrive together and mlx_lm prefills them in one batch: W streams need
    W prefill chunks beside their caches."""
    b = MemoryBudget(total_bytes=563 * MiB, weight_bytes=0, prefill_bytes=2 * MiB)
    t = build_table(GEMMA3, b, 8)
    for w, d in t.widths().items():
        assert d == 0 or w * (t.stream_bytes(d) + 2 * MiB) <= b.drained_bytes < w * (t.stream_bytes(d + 1) + 2 * MiB)
    assert t.max_width_at_depth(512) == b.drained_bytes // (t.stream_bytes(512) + 2 * MiB)
    assert t.max_context_at_width(1) == max(d for d in range(0, 32769, 256) if t.stream_bytes(d) <= b.kv_bytes)


def test_gemma3_table_saturates_sliding_layers() -> None:
    t = build_table(GEMMA3, MemoryBudget(total_bytes=563 * MiB, weight_bytes=0, prefill_bytes=0), 8)
    assert t.budget.kv_bytes == 51 * MiB  # 563 MiB less the 512 MiB floor
    # A stream's 2 logits rows over 262144 tokens in float32 take 2 MiB, which leaves 49 MiB of KV.
    # Past 512 tokens only the 3 global layers grow: 3072 bytes a token on top of 15360 x 512.
    # (49 MiB - 15360 x 512) / 3072 = 14165.3 tokens, rounded down to whole steps of 256.
    assert t.max_context_at_width(1) == 14080
    assert 3072 * 14080 + 15360 * 512 <= 49 * MiB < 3072 * (14080 + 256) + 15360 * 512
    # 7 streams get 51 / 7 - 2 = 5.29 MiB of KV each: 256 tokens take 18432 x 256 = 4.5 MiB, 512 take 9;
    # 8 get 4.375 MiB, not one step.
    assert t.max_context_at_width(7) == 256 and t.max_context_at_width(8) == 0
    assert depth_grid(32768)[-1] == 32768 and depth_grid(300) == [300]


# ---- plan ------------------------------------------------------------------------------------

IDLE = LiveState(decode_batch=8, in_flight=0, waiting=0, band="green")


def test_plan_ok() -> None:
    p = plan(small_table(), 4, 512, dataclasses.replace(IDLE, in_flight=1), "m")
    assert p == {
        "width": 4,
        "depth": 512,
        "ok": True,
        "max_context_at_width": 512,
        "max_width_at_depth": 4,
        "model": "m",
        "band": "green",
        "decode_batch": 8,
        "in_flight": 1,
        "waiting": 0,
        "slots": 7,
        "admit_now": True,
        "reason": "ok",
    }


@pytest.mark.parametrize(
    ("width", "depth", "live", "reason"),
    [
        (2, 2048, IDLE, "depth 2048 exceeds max context 1024 at width 2"),
        (1, 256, dataclasses.replace(IDLE, band="orange"), "governor orange"),
        (1, 256, dataclasses.replace(IDLE, band="red"), "governor red"),
        (1, 256, dataclasses.replace(IDLE, waiting=2), "2 waiting for a slot"),
        (4, 256, dataclasses.replace(IDLE, in_flight=5), "3 free slot(s) of 8, need 4"),
        (1, 256, dataclasses.replace(IDLE, in_flight=9), "0 free slot(s) of 8, need 1"),
        (9, 1, IDLE, "width 9 exceeds the decode batch 8"),  # never together, whatever the memory
        # A server taking no work at all says why first; then the memory answer, the governor,
        # the queue and the slots.
        (2, 2048, LiveState(8, 8, 3, "red", not_ready="shutting down"), "shutting down"),
        (2, 2048, LiveState(8, 8, 3, "red"), "depth 2048 exceeds max context 1024 at width 2"),
        (1, 256, LiveState(8, 8, 3, "orange"), "governor orange"),
        (1, 256, LiveState(8, 8, 3, "green"), "3 waiting for a slot"),
    ],
)
def test_plan_reasons(width: int, depth: int, live: LiveState, reason: str) -> None:
    p = plan(small_table(), width, depth, live, "m")
    assert p["reason"] == reason and p["admit_now"] is False
    assert p["ok"] is (p["max_width_at_depth"] >= width)  # the memory answer agrees with the table it shows
    assert p["slots"] == max(0, live.decode_batch - live.in_flight)


def test_plan_yellow_counts_one_slot() -> None:
    yellow = dataclasses.replace(IDLE, band="yellow")
    assert plan(small_table(), 1, 256, yellow, "m")["admit_now"] is True
    p = plan(small_table(), 2, 256, yellow, "m")
    assert p["reason"] == "1 free slot(s) of 8, need 2" and p["slots"] == 8 and not p["admit_now"]
    full = dataclasses.replace(yellow, in_flight=8)
    assert plan(small_table(), 1, 256, full, "m")["reason"] == "0 free slot(s) of 8, need 1"


def test_plan_without_table_or_under_overcommit() -> None:
    p = plan(None, 2, 10**6, LiveState(8, 0, 0), "m")
    assert p["ok"] is None and p["max_context_at_width"] is None and p["max_width_at_depth"] is None
    assert p["band"] is None and p["admit_now"] is True and p["reason"] == "ok"
    p = plan(small_table(), 2, 2048, IDLE, "m", overcommit=True)
    assert p["ok"] is None and p["admit_now"] is True  # memory no longer decides
    assert p["max_context_at_width"] == 1024 and p["max_width_at_depth"] == 1  # but is still reported
    with pytest.raises(ValueError, match="width"):
        plan(None, 0, 1, IDLE, "m")


# ---- estimate --------------------------------------------------------------------------------


def test_estimate_fields() -> None:
    need = 1000 + (3072 + 15360) * 512 + 2 * 262144 * 4  # prefill + KV of 300 + 212 tokens + logits rows
    e = estimate(
        GEMMA3,
        prompt_tokens=300,
        max_tokens=212,
        context_limit=32768,
        prefill_bytes=1000,
        free_now_bytes=need,
        free_drained_bytes=need - 1,
        prefill_tok_s=400.0,
        queue_wait_s=0.5,
        warm_tokens=100,
        cache_tier="block",
    )
    assert e == {
        "kind": "generation",
        "prompt_tokens": 300,
        "warm_tokens": 100,
        "cache_tier": "block",
        "need_bytes": need,
        "need_now_bytes": need,
        "fits_now": True,
        "fits_drained": False,
        "context_ok": True,
        "context_limit": 32768,
        "est_ttft_s": 1.0,  # 0.5 s queue + 200 cold tokens at 400 tok/s
        "resident": True,
    }


def test_prefill_fit_recovers_a_fixed_cost_and_a_rate() -> None:
    # served chunks of 12 to 512 tokens at 20 ms each plus 1 ms a token, with a little noise
    chunks = [(12, 0.0321), (64, 0.0838), (256, 0.2762), (512, 0.5318), (40, 0.0598)]
    fit = fit_prefill(chunks)
    assert fit is not None and abs(fit.fixed_s - 0.02) < 0.002 and abs(fit.per_token_s - 0.001) < 2e-5
    assert fit.seconds(0, 512) == 0.0
    assert fit.seconds(1100, 512) == 3 * fit.fixed_s + 1100 * fit.per_token_s  # three chunks
    assert fit_prefill([(256, 0.3), (300, 0.34)]) is None  # lengths too alike to tell fixed from rate
    assert fit_prefill([(12, 0.5), (512, 0.1)]) is None  # longer, faster: not a prefill
    assert fit_prefill([(12, 0.03)]) is None
    e = estimate(
        GEMMA3,
        prompt_tokens=300,
        max_tokens=None,
        context_limit=32768,
        prefill_bytes=0,
        free_now_bytes=None,
        free_drained_bytes=None,
        prefill_tok_s=400.0,
        queue_wait_s=0.5,
        first_step_s=0.02,
        prefill_fit=PrefillFit(0.02, 0.001),
        prefill_step=512,
        warm_tokens=100,
    )
    assert e["est_ttft_s"] == 0.74  # the queue, one chunk of 200 cold tokens by the fit (not the rate), a step


def test_joining_a_batch_pads_to_its_longest_row() -> None:
    """Rows of a batch are as deep as its deepest: a short request beside a long one costs a long
    row, and a request deeper than the rest grows theirs to its depth."""
    row = lambda depth: stream_bytes(LLAMA, depth)  # noqa: E731
    args = dict(context_limit=4096, prefill_bytes=0, free_drained_bytes=None, prefill_tok_s=None, queue_wait_s=0.0)
    short = estimate(
        LLAMA, prompt_tokens=20, max_tokens=None, free_now_bytes=row(1036), running=1, longest=1036, **args
    )
    assert short["need_bytes"] == row(20) and short["need_now_bytes"] == row(1036) and short["fits_now"] is True
    deep = estimate(
        LLAMA, prompt_tokens=2000, max_tokens=None, free_now_bytes=row(2000), running=2, longest=300, **args
    )
    assert deep["need_now_bytes"] == 3 * row(2000) - 2 * row(300) and deep["fits_now"] is False
    alone = estimate(LLAMA, prompt_tokens=20, max_tokens=None, free_now_bytes=row(20), **args)
    assert alone["need_now_bytes"] == alone["need_bytes"] and alone["fits_now"] is True


def test_estimate_without_rates_or_free_figures() -> None:
    e = estimate(
        LLAMA,
        prompt_tokens=4096,
        max_tokens=None,
        context_limit=4096,
        prefill_bytes=0,
        free_now_bytes=None,
        free_drained_bytes=None,
        prefill_tok_s=None,
        queue_wait_s=0.0,
        resident=False,
        kv=Q8,
    )
    assert e["need_bytes"] == kv_bytes(LLAMA, 4096, Q8) + 2 * 128256 * 4 == 4096 * 32 * 8 * 2 * 136 + 1026048
    assert e["fits_now"] is None and e["fits_drained"] is None and e["est_ttft_s"] is None
    assert e["context_ok"] is False  # no room left for one generated token
    for max_tokens, ok in ((4, True), (5, False)):  # a window of 8: 4 + 4 fits, 4 + 5 would be a 400
        assert (
            estimate(
                LLAMA,
                prompt_tokens=4,
                max_tokens=max_tokens,
                context_limit=8,
                prefill_bytes=0,
                free_now_bytes=None,
                free_drained_bytes=None,
                prefill_tok_s=None,
                queue_wait_s=0.0,
            )["context_ok"]
            is ok
        )
    assert e["resident"] is False and e["cache_tier"] == "miss" and e["warm_tokens"] == 0
    e = estimate(
        LLAMA,
        prompt_tokens=3,
        max_tokens=None,
        context_limit=4096,
        prefill_bytes=0,
        free_now_bytes=None,
        free_drained_bytes=None,
        prefill_tok_s=3.0,
        queue_wait_s=0.0,
    )
    assert e["est_ttft_s"] == 1.0
