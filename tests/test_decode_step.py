"""The engine's steps (gmlx.upstream.own_steps: the first token sampled from the last prefill chunk,
the decode step on the logits) give the same greedy tokens as mlx_lm's own BatchGenerator on
the default model, in every weight mode, alone and batched with 7 others."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlx_lm.generate import BatchGenerator

from gmlx import upstream
from gmlx.engine.sampling import greedy, sample_rows
from gmlx.models.loader import LoadedModel, load
from gmlx.models.weights_mode import gguf_kernels_reason

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colours are",
    "To make a cup of tea, first",
    "Water boils at a temperature of",
    "The quick brown fox",
    "In 1969, the first person to walk on the Moon was",
]
TOKENS = {"native": 4, "float": 16, "gguf": 16}  # native is MLX's quantized matmul: 4 s a batch-8 step on a CPU


def generate(loaded: LoadedModel, prompts: list[list[int]], own_step: bool, tokens: int) -> list[list[int]]:
    gen = BatchGenerator(loaded.model, stop_tokens=[], completion_batch_size=8, prefill_batch_size=8)
    if own_step:
        upstream.own_steps(gen, lambda logits, tokens, uids: [None] * len(uids), lambda uid: False, sample_rows)
    uids = gen.insert(prompts, [tokens] * len(prompts), samplers=[greedy] * len(prompts))
    out: dict[int, list[int]] = {uid: [] for uid in uids}
    while any(len(t) < tokens for t in out.values()):
        _, responses = gen.next()
        for r in responses:
            out[r.uid].append(r.token)
    gen.close()
    return [out[uid] for uid in uids]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["native", "float", "gguf"])
def test_greedy_tokens_match_mlx_lms_step_alone_and_in_a_batch_of_8(default_model: Path, mode: str) -> None:
    if mode == "gguf" and (why := gguf_kernels_reason()) is not None:
        pytest.skip(why)
    loaded = load(default_model, mode)  # type: ignore[arg-type]
    prompts = [loaded.tokenizer.encode(p) for p in PROMPTS]
    n = TOKENS[mode]
    alone = generate(loaded, prompts[:1], own_step=True, tokens=n)
    assert alone == generate(loaded, prompts[:1], own_step=False, tokens=n)
    batched = generate(loaded, prompts, own_step=True, tokens=n)
    assert batched == generate(loaded, prompts, own_step=False, tokens=n)
    assert batched[0] == alone[0]  # and the batch leaves each row's tokens as they were alone
    assert len({tuple(t) for t in batched}) == len(PROMPTS)  # each prompt its own continuation
