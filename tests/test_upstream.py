"""Each private part of mlx_lm, uvicorn and typer that gmlx.upstream reaches still behaves as it
did in the version it was checked against. (uvicorn's h11 protocol internals, which
gmlx.server.connections subclasses, are checked by tests/test_connections.py.)"""

from __future__ import annotations

import signal
from importlib.metadata import version
from pathlib import Path

import mlx.core as mx
import pytest
import uvicorn
from mlx_lm.models.cache import BatchKVCache
from transformers import PreTrainedTokenizerFast

from gmlx import upstream
from gmlx.engine.sampling import sample_rows

# The relay against mlx_lm's generator: the same model, rows batched otherwise. Keys computed in
# another batch layout can differ in float32's last bits, and where the KV cache stores float16 such
# a key can round to the neighbouring float16 (2^-10 relative), which the layers above and the
# tokens after carry on: over a relay of 300 tokens logprobs differed by up to 7e-4, cached keys and
# values by a float16 unit or 1e-4 (a misplaced slot or position differs by 0.1 to 1 and more).
LOGPROB_TOL = dict(atol=2e-3)
KV_TOL = dict(rtol=2**-10, atol=1e-3)  # one float16 unit, or what the layers carry on


def test_the_checked_versions_are_the_ones_installed_or_within_the_pins() -> None:
    for package, checked in upstream.CHECKED.items():
        assert version(package).split(".")[:2] == checked.split(".")[:2], (package, version(package), checked)


def test_a_batch_cache_reports_its_filled_slots_and_right_padding() -> None:
    cache = BatchKVCache([0, 0])
    assert upstream.right_padding(cache) is None and upstream.filled(cache) == 0
    keys = mx.zeros((2, 1, 3, 4))
    cache.update_and_fetch(keys, keys)
    assert upstream.filled(cache) == 3 and cache.keys.shape[2] >= 3  # written slots, not the buffer's length
    upstream.set_filled(cache, 1)
    k, _ = cache.update_and_fetch(keys[:, :, :1], keys[:, :, :1])
    assert k.shape[2] == 2  # the next write lands after the slots set, and attention sees only those

    padded = BatchKVCache([0, 0])
    padded.prepare(lengths=[3, 1], right_padding=[0, 2])
    assert upstream.right_padding(padded).tolist() == [0, 2]
    padded.update_and_fetch(keys, keys)
    padded.finalize()
    assert upstream.right_padding(padded) is None  # gone once the padded rows are rolled into place


def test_a_tokenizer_wrapper_holds_a_fast_transformers_tokenizer(tiny_models: dict[str, Path]) -> None:
    from gmlx.gguf.header import read_header
    from gmlx.gguf.tokenizer import load_tokenizer

    wrapper = load_tokenizer(read_header(tiny_models["llama"]))
    hf = upstream.hf_tokenizer(wrapper)
    assert isinstance(hf, PreTrainedTokenizerFast)
    assert hf.encode("hello world") == wrapper.encode("hello world")


def test_uvicorn_forgets_the_signals_it_would_raise_again(monkeypatch: pytest.MonkeyPatch) -> None:
    raised: list[int] = []
    monkeypatch.setattr(signal, "raise_signal", raised.append)

    async def app(scope, receive, send) -> None:  # never called
        raise AssertionError

    server = uvicorn.Server(uvicorn.Config(app))
    with server.capture_signals():
        server.handle_exit(signal.SIGTERM, None)
        server.handle_exit(signal.SIGHUP, None)
        upstream.forget_signals(server)
    assert raised == [signal.SIGHUP]  # uvicorn re-raises what it captured, less what gmlx forgot


def keep_all(logits: mx.array, tokens: mx.array, uids: list[int]) -> list[mx.array]:
    """Every row's processed logits as its response's `logprobs`."""
    return [logits[e] for e in range(len(uids))]


def keep_row_0(logits: mx.array, tokens: mx.array, uids: list[int]) -> list[mx.array | None]:
    return [logits[e] if uid == 0 else None for e, uid in enumerate(uids)]


def test_typer_writes_each_shells_completion_script() -> None:
    for shell, marker in (("bash", "complete -o"), ("zsh", "compdef"), ("fish", "complete --command")):
        script = upstream.completion_script("gmlx", "_GMLX_COMPLETE", shell)
        assert marker in script and "_GMLX_COMPLETE" in script, shell


def test_the_batch_generator_takes_gmlxs_steps_and_keeps_only_the_rows_asked(
    tiny_models: dict[str, Path],
) -> None:
    from mlx_lm.generate import BatchGenerator

    from gmlx.engine.sampling import greedy
    from gmlx.models.loader import load

    model = load(tiny_models["llama"], "float").model

    def run(own_step: bool) -> tuple[dict[int, list[int]], dict[int, list[bool]]]:
        gen = BatchGenerator(model, stop_tokens=[], completion_batch_size=2, prefill_batch_size=2)
        if own_step:
            upstream.own_steps(gen, keep_row_0, lambda uid: False, sample_rows)
        uids = gen.insert([[1, 7, 9], [1, 4]], [6, 6], samplers=[greedy, greedy])
        tokens: dict[int, list[int]] = {u: [] for u in uids}
        kept: dict[int, list[bool]] = {u: [] for u in uids}
        while any(len(t) < 6 for t in tokens.values()):
            for r in gen.next()[1]:
                tokens[r.uid].append(r.token)
                kept[r.uid].append(r.logprobs is not None)
        return tokens, kept

    tokens, kept = run(own_step=True)
    assert tokens == run(own_step=False)[0]
    # The first token too is sampled in gmlx's step (from the prefill's last chunk): only row 0 keeps logits.
    assert kept == {0: [True] * 6, 1: [False] * 6}


def test_a_decode_steps_tokens_are_handed_out_before_the_next_step_is_queued_whole(
    tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`deliver` gets each decode step's responses once, as next() returns them. Where they hold
    a row's first token, or every row's last, the step after is queued only up to its first
    layer meanwhile (queued whole, MLX's async_eval returns when that step is nearly done, and
    the tokens would reach their clients a step late); a step no row is left to read is never
    queued."""
    from mlx_lm.generate import BatchGenerator

    from gmlx.engine.sampling import greedy
    from gmlx.models.loader import load

    model = load(tiny_models["llama"], "float").model
    gen = BatchGenerator(model, stop_tokens=[], completion_batch_size=2, prefill_batch_size=2)
    handed: list[list[tuple[int, int]]] = []
    rest_queued: list[bool] = []

    def deliver(responses: list) -> None:
        handed.append([(r.uid, r.token) for r in responses])
        rest_queued.append(gen._generation_batch._queued is None)

    finish, finished_live = upstream.finish_step, []
    monkeypatch.setattr(
        upstream, "finish_step", lambda b: (b._queued is not None and finished_live.append(b.live), finish(b))
    )
    upstream.own_steps(gen, keep_row_0, lambda uid: False, sample_rows, deliver)
    gen.insert([[1, 7, 9], [1, 4]], [6, 3], samplers=[greedy, greedy])
    returned = []
    for _ in range(12):
        if responses := [(r.uid, r.token) for r in gen.next()[1]]:
            returned.append(responses)
    assert handed == returned and sum(len(step) for step in handed) == 9
    # both first tokens, then the second row's last (the first goes on), then the first row's last
    assert rest_queued == [False, True, True, True, True, False]
    assert finished_live == [2, 2, 2, 1, 1]  # the step after the last row's end was never queued


def test_prompts_past_the_sliding_window_join_a_decoding_batch_with_mlx_lms_logits(
    tiny_models: dict[str, Path],
) -> None:
    """first_token_from_prefill cuts a sliding cache that a chunk left longer than its window
    (tiny gemma3: 64 tokens) before the row joins; rows joining mid-decode, and a chunk that ends
    one prompt while another goes on, see what they see in mlx_lm's own generator."""
    import numpy as np
    from mlx_lm.generate import BatchGenerator

    from gmlx.engine.sampling import greedy
    from gmlx.models.loader import load

    model = load(tiny_models["gemma3"], "float").model
    prompts = [[1] + [7 + (i * 13) % 90 for i in range(n)] for n in (20, 150, 90, 200)]

    def run(own_steps: bool) -> list[list[tuple[int, np.ndarray]]]:
        gen = BatchGenerator(model, stop_tokens=[], completion_batch_size=4, prefill_batch_size=4, prefill_step_size=48)
        if own_steps:
            upstream.own_steps(gen, keep_all, lambda uid: False, sample_rows)
        out: dict[int, list[tuple[int, np.ndarray]]] = {u: [] for u in gen.insert(prompts[:1], [30], samplers=[greedy])}
        for step in range(60):
            if step == 3:  # two join while the first decodes, ending their prompts in different chunks
                out.update({u: [] for u in gen.insert(prompts[1:3], [20, 20], samplers=[greedy] * 2)})
            if step == 9:
                out.update({u: [] for u in gen.insert(prompts[3:], [10], samplers=[greedy])})
            for r in gen.next()[1]:
                out[r.uid].append((r.token, np.array(r.logprobs - mx.logsumexp(r.logprobs))))
        gen.close()
        return list(out.values())

    ours, theirs = run(own_steps=True), run(own_steps=False)
    assert [len(t) for t in ours] == [30, 20, 20, 10]
    for row, row_theirs in zip(ours, theirs, strict=True):
        assert [t for t, _ in row] == [t for t, _ in row_theirs]
        for (_, a), (_, b) in zip(row, row_theirs):
            np.testing.assert_allclose(a, b, **LOGPROB_TOL)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_prompt_whose_first_token_is_its_last_never_joins_the_decode_batch(
    tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch, arch: str
) -> None:
    """Rows with max_tokens 1, ending their prompts beside one that goes on to decode and while
    another decodes, answer from the prefill: the same token, logits and finish as mlx_lm's own
    generator, their caches for the prompt cache (sliding ones cut to the window: tiny gemma3's is
    64 tokens), and no join (which would copy every decoding row's cache in and out again)."""
    import numpy as np
    from mlx_lm.generate import BatchGenerator

    from gmlx.engine.sampling import greedy
    from gmlx.models.loader import load

    model = load(tiny_models[arch], "float").model
    prompts = [[1, 7, 9, 11], [1, 4, 5], [1] + [30 + i % 50 for i in range(100)], [1, 8]]
    limits = [8, 1, 1, 3]
    joined: list[int] = []
    join = upstream._join
    monkeypatch.setattr(upstream, "_join", lambda decoding, batch: (joined.extend(batch.uids), join(decoding, batch)))

    def run(own_steps: bool) -> list[list[tuple[int, str | None, np.ndarray, list[int] | None]]]:
        gen = BatchGenerator(model, stop_tokens=[], completion_batch_size=4, prefill_batch_size=4)
        if own_steps:
            upstream.own_steps(gen, keep_all, lambda uid: False, sample_rows)
        uids = gen.insert(prompts[:1], limits[:1], samplers=[greedy])
        out: dict[int, list] = {uids[0]: []}
        for step in range(12):
            if step == 2:
                out.update({u: [] for u in gen.insert(prompts[1:], limits[1:], samplers=[greedy] * 3)})
            for r in gen.next()[1]:
                logits = np.array(r.logprobs - mx.logsumexp(r.logprobs))
                cached = None if r.prompt_cache is None else list(r.all_tokens)
                for c in r.prompt_cache or []:
                    assert c.keys.shape[2] <= getattr(c, "max_size", c.keys.shape[2])
                out[r.uid].append((r.token, r.finish_reason, logits, cached))
        gen.close()
        return list(out.values())

    ours = run(own_steps=True)
    assert set(joined) == {0, 3}  # the rows that decode joined; the one-token rows did not
    theirs = run(own_steps=False)
    assert [len(t) for t in ours] == limits
    for row, row_theirs in zip(ours, theirs, strict=True):
        assert [(t, f) for t, f, *_ in row] == [(t, f) for t, f, *_ in row_theirs]
        for (*_, a, _), (*_, b, _) in zip(row, row_theirs):
            np.testing.assert_allclose(a, b, **LOGPROB_TOL)
    for prompt, row in zip(prompts[1:3], ours[1:3]):
        assert row[0][1] == "length" and row[0][3] == prompt  # the cache it leaves holds the prompt


@pytest.mark.parametrize("window", [None, 8])
@pytest.mark.parametrize(
    ("lengths", "joining", "steps"), [((5, 9), (3,), 0), ((5, 9), (20,), 6), ((30,), (4, 12), 3), ((30, 11), (2,), 2)]
)
def test_a_batch_cache_extends_in_one_copy_to_mlx_lms_state(
    window: int | None, lengths: tuple[int, ...], joining: tuple[int, ...], steps: int
) -> None:
    """The decode batch's caches take a joining row's as mlx_lm's extend would: full and
    sliding-window caches, rotated or not, the joining rows shorter or longer."""
    import copy

    import numpy as np
    from mlx_lm.models.cache import BatchRotatingKVCache, KVCache, RotatingKVCache

    rng = np.random.default_rng(len(lengths) + 10 * steps)

    def batch(sizes: tuple[int, ...]) -> object:
        caches = []
        for n in sizes:
            c = KVCache() if window is None else RotatingKVCache(window)
            c.update_and_fetch(*(mx.array(rng.normal(size=(1, 2, n, 4)), dtype=mx.float32) for _ in range(2)))
            caches.append(c)
        merged = (BatchKVCache if window is None else BatchRotatingKVCache).merge(caches)
        for _ in range(steps):  # decode steps: a window past its size rotates
            merged.update_and_fetch(
                *(mx.array(rng.normal(size=(len(sizes), 2, 1, 4)), dtype=mx.float32) for _ in range(2))
            )
        return merged

    ours, other = batch(lengths), batch(joining)
    theirs = copy.deepcopy(ours)
    theirs.extend(copy.deepcopy(other))
    upstream._extend_in_one_copy(ours, other)
    for a, b in zip(ours.state, theirs.state, strict=True):
        assert np.array_equal(np.array(a), np.array(b)) if isinstance(a, mx.array) else a == b
    assert ours._idx == theirs._idx
    if window is not None:
        assert (ours.rotated, ours._offset) == (theirs.rotated, theirs._offset)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_rows_joining_free_slots_see_what_they_see_in_mlx_lms_generator(
    tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch, arch: str
) -> None:
    """A relay of requests, each sent as another ends (as clients send their next), into a decode
    batch that keeps its rows' slots: rows take the slots rows left, shorter and longer than the
    batch has filled, before and after the sliding window (tiny gemma3's: 64 tokens) is full, a
    long-lived row's leave cuts the full caches' unused front, and every token and logit is
    mlx_lm's own generator's (which moves every row on each join and leave)."""
    import numpy as np
    from mlx_lm.generate import BatchGenerator

    from gmlx.engine.sampling import greedy
    from gmlx.models.loader import load

    model = load(tiny_models[arch], "float").model
    relay = [(4 + (i * 37) % 90, 5 + (i * 23) % 40) for i in range(30)]  # (prompt length, max_tokens)
    first = [(30, 300), (12, 8), (50, 20)]
    prompts = [[1] + [7 + (i * 13 + n) % 90 for i in range(n)] for n, _ in first + relay]
    limits = [m for _, m in first + relay]
    placed, trimmed = [], []
    write, trim = upstream._write_row, upstream._trim_front
    monkeypatch.setattr(upstream, "_write_row", lambda mine, slot, *a: (placed.append(slot), write(mine, slot, *a)))
    monkeypatch.setattr(
        upstream,
        "_trim_front",
        lambda caches, rows: (trimmed.append(caches[0]._idx), trim(caches, rows), trimmed.append(caches[0]._idx)),
    )

    def run(own_steps: bool) -> tuple[dict[int, list[tuple[int, np.ndarray]]], dict[int, list[np.ndarray]]]:
        gen = BatchGenerator(model, stop_tokens=[], completion_batch_size=3, prefill_batch_size=3, prefill_step_size=64)
        if own_steps:
            upstream.own_steps(gen, keep_all, lambda uid: False, sample_rows)
        sent = 3
        rows = gen.insert(prompts[:3], limits[:3], samplers=[greedy] * 3)
        out: dict[int, list[tuple[int, np.ndarray]]] = {i: [] for i in range(3)}
        left: dict[int, list[np.ndarray]] = {}  # each row's cache as it leaves (the prompt cache keeps it)
        which = dict(zip(rows, range(3)))
        while any(len(out.get(i, [])) < limits[i] for i in range(len(prompts))):
            for r in gen.next()[1]:
                out[which[r.uid]].append((r.token, np.array(r.logprobs - mx.logsumexp(r.logprobs))))
                if r.finish_reason is not None:
                    left[which[r.uid]] = [np.array(a) for c in r.prompt_cache for a in (c.keys, c.values)]
                if r.finish_reason is not None and sent < len(prompts):
                    [uid] = gen.insert([prompts[sent]], [limits[sent]], samplers=[greedy])
                    which[uid], out[sent] = sent, []
                    sent += 1
        gen.close()
        return out, left

    ours, ours_left = run(own_steps=True)
    assert len(placed) >= 8 * len(model.layers)  # most of the relay took free slots
    if arch == "llama":
        assert any(after < before for before, after in zip(trimmed[::2], trimmed[1::2]))
    theirs, theirs_left = run(own_steps=False)
    assert [len(ours[i]) for i in range(len(prompts))] == limits
    for i in range(len(prompts)):
        assert [t for t, _ in ours[i]] == [t for t, _ in theirs[i]], i
        for (_, a), (_, b) in zip(ours[i], theirs[i]):
            np.testing.assert_allclose(a, b, **LOGPROB_TOL)
        for a, b in zip(ours_left[i], theirs_left[i], strict=True):
            np.testing.assert_allclose(a, b, **KV_TOL)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_a_chunk_run_layer_by_layer_evaluates_each_layer_in_turn_and_computes_the_same(
    tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch, arch: str
) -> None:
    """layer_by_layer evaluates every layer's output but the last as the layer returns (so a
    prefill chunk holds one layer's activations, as the capacity table counts), gives the model's
    own logits, and hands the model its layers back, also when the call fails."""
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache

    from gmlx.models.loader import load

    model = load(tiny_models[arch], "float").model
    layers = list(model.model.layers)
    inputs = mx.array([[1] + [7 + (i * 13) % 90 for i in range(40)]])
    plain = model(inputs, cache=make_prompt_cache(model))
    mx.eval(plain)

    evaluated: list[int] = []
    real_eval = mx.eval
    monkeypatch.setattr(mx, "eval", lambda *a: (evaluated.append(len(evaluated)), real_eval(*a))[1])
    with upstream.layer_by_layer(model):
        chunked = model(inputs, cache=make_prompt_cache(model))
    monkeypatch.setattr(mx, "eval", real_eval)
    assert len(evaluated) == len(layers) - 1
    np.testing.assert_allclose(np.array(chunked), np.array(plain), atol=1e-5)
    assert model.model.layers == layers

    with pytest.raises(ValueError), upstream.layer_by_layer(model):
        raise ValueError("a chunk that fails")
    assert model.model.layers == layers
