"""The prompt cache: which tier a prompt hits, how many tokens it reuses, that reused KV gives the
same logits and the same greedy text as a cold prefill, and that the cache keeps to its bound."""

from __future__ import annotations

import threading
from pathlib import Path

import mlx.core as mx
import pytest
from conftest import LiveServer
from mlx_lm.models.cache import make_prompt_cache

from gmlx.engine.engine import Chunk, Engine, Event, Finished, Request
from gmlx.engine.prompt_cache import PromptCache
from gmlx.engine.sampling import SamplingParams
from gmlx.models.loader import LoadedModel, load

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from tiny_models import write_model

    root = tmp_path_factory.mktemp("pc")
    return {arch: write_model(root / f"{arch}.gguf", arch, context=4096) for arch in ("llama", "gemma3")}


@pytest.fixture(scope="module")
def llama(tiny: dict[str, Path]) -> LoadedModel:
    return load(tiny["llama"], "float")


def prompt(n: int, salt: int = 0) -> list[int]:
    return [5 + (i * 7 + salt * 13) % 300 for i in range(n)]


def prefilled(m: LoadedModel, tokens: list[int]) -> list:
    cache = make_prompt_cache(m.model)
    m.model(mx.array([tokens]), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def last_logits(m: LoadedModel, tokens: list[int], cache: list | None = None) -> mx.array:
    cache = cache if cache is not None else make_prompt_cache(m.model)
    return m.model(mx.array([tokens]), cache=cache)[0, -1]


# --- the cache on its own ------------------------------------------------------------------


def test_tiers_and_warm_tokens(llama: LoadedModel) -> None:
    pc = PromptCache(1 << 30, block_tokens=16)
    a = prompt(100)
    assert pc.fetch(a)[0].tier == "miss"
    pc.store(a + [9, 9], prefilled(llama, a + [9, 9]), "final")  # a request's prompt and its two outputs
    hit, cache = pc.fetch(a)  # the same prompt again: all but its last token
    assert (hit.tier, hit.warm_tokens) == ("exact", 99) and cache is not None and cache[0].offset == 99
    diverging = a[:50] + prompt(30, salt=1)
    assert pc.peek(diverging).to_json() == {"tier": "block", "warm_tokens": 48}  # 50 shared, in whole blocks
    assert pc.peek(a + [9, 9, 4, 4]).to_json() == {"tier": "block", "warm_tokens": 102}  # the next turn: all of it
    assert pc.peek(prompt(40, salt=2)).tier == "miss"
    pc.store(a[:30], prefilled(llama, a[:30]), "anchor")
    assert pc.peek(a[:30] + prompt(20, salt=3)).to_json() == {"tier": "anchor", "warm_tokens": 30}
    st = pc.snapshot()
    assert (st["hits"], st["misses"], st["reused_tokens"]) == (1, 1, 99)  # peeks count nothing
    assert st["hits_by_tier"]["exact"] == 1 and st["entries"] == 2 and st["bytes"] == st["stored_bytes"]


def test_reused_kv_gives_the_cold_logits(llama: LoadedModel) -> None:
    pc = PromptCache(1 << 30)
    a, b = prompt(80), prompt(80)[:64] + prompt(20, salt=5)
    pc.store(a, prefilled(llama, a), "final")
    for tokens in (a, b):
        hit, cache = pc.fetch(tokens)
        warm = last_logits(llama, tokens[hit.warm_tokens :], cache)
        assert hit.warm_tokens > 0 and mx.allclose(warm, last_logits(llama, tokens), atol=1e-4).item()
    # Trimming a copy left the stored entry whole: the exact hit still holds all 79 tokens.
    assert pc.peek(a).warm_tokens == 79


def test_bound_lru_eviction_and_release(llama: LoadedModel) -> None:
    one = sum(c.nbytes for c in prefilled(llama, prompt(64)))
    pc = PromptCache(2 * one + one // 2)
    for salt in range(3):
        assert pc.store(prompt(64, salt), prefilled(llama, prompt(64, salt)), "final")
    st = pc.snapshot()
    assert st["entries"] == 2 and st["bytes"] <= pc.max_bytes and st["evicted_bytes"] == one
    assert pc.peek(prompt(64, 0)).tier == "miss" and pc.peek(prompt(64, 2)).tier == "exact"  # oldest went first
    assert not pc.store(prompt(600), prefilled(llama, prompt(600)), "final")  # bigger than the whole bound
    assert pc.evict_coldest(1) == one and pc.peek(prompt(64, 1)).tier == "miss"  # the coldest entry alone
    assert pc.peek(prompt(64, 2)).tier == "exact"
    assert pc.evict_coldest(10 * one) == one and pc.bytes == 0 and pc.snapshot()["entries"] == 0


def test_a_longer_turn_replaces_the_entries_it_contains(llama: LoadedModel) -> None:
    pc = PromptCache(1 << 30)
    a = prompt(96)
    pc.store(a[:40], prefilled(llama, a[:40]), "anchor")
    pc.store(a[:60], prefilled(llama, a[:60]), "final")
    pc.store(a, prefilled(llama, a), "final")  # trims to a[:60], so that entry only took space
    assert pc.snapshot()["entries_by_kind"] == {"anchor": 1, "final": 1}


# --- the engine with a cache -----------------------------------------------------------------


class Runner:
    def __init__(self, path: Path, **kw: object) -> None:
        self.cache = PromptCache(1 << 30)
        self.engine = Engine(
            lambda: load(path, "float"), "pc", decode_batch=4, prefill_step=256, prompt_cache=self.cache, **kw
        )  # type: ignore[arg-type]
        self.engine.start()
        assert self.engine.ready.wait(60) and self.engine.loaded is not None

    def run(self, ids: list[int], max_tokens: int = 8, anchor: int = 0) -> tuple[str, Finished, Request]:
        done, text, end = threading.Event(), [], []

        def emit(e: Event) -> None:
            if isinstance(e, Chunk):
                text.append(e.text)
            else:
                end.append(e)
                done.set()

        req = Request(f"r{len(ids)}-{anchor}", ids, max_tokens, GREEDY, emit=emit, anchor_tokens=anchor)
        self.engine.submit(req)
        assert done.wait(120)
        assert isinstance(end[0], Finished), end
        return "".join(text), end[0], req

    def prefilled_by(self, ids: list[int], **kw: object) -> tuple[Request, int, Finished]:
        before = self.engine.stats.prefill_tokens
        _, end, req = self.run(ids, **kw)  # type: ignore[arg-type]
        return req, self.engine.stats.prefill_tokens - before, end


@pytest.fixture(params=["llama", "gemma3"])
def runner(request: pytest.FixtureRequest, tiny: dict[str, Path]) -> Runner:
    r = Runner(tiny[request.param], checkpoint_every=256)
    yield r
    r.engine.stop()


def test_a_repeated_prompt_hits_exact_and_skips_its_prefill(runner: Runner) -> None:
    ids = prompt(1500)
    cold, prefilled_cold, first = runner.prefilled_by(ids)
    warm, prefilled_warm, second = runner.prefilled_by(ids)
    assert cold.cache.tier == "miss" and prefilled_cold == len(ids)
    # the cache holds all but the last token: that one is prefilled again, its logits giving the first token
    assert (warm.cache.tier, warm.cache.warm_tokens) == ("exact", len(ids) - 1) and prefilled_warm == 1
    assert second.cached_tokens == len(ids) - 1
    assert second.ttft_s < first.ttft_s / 2  # the engine's own timing: 1499 tokens not prefilled again


def test_a_longer_prompt_reuses_its_prefix(runner: Runner) -> None:
    ids = prompt(700)
    runner.run(ids)
    req, prefilled, _ = runner.prefilled_by(ids + prompt(40, salt=9))
    # The plain model trims the first request's cache to whole blocks; the sliding one (past its
    # 64-token window, so its cache cannot be trimmed) restores the checkpoint kept before the last token.
    expected = {"llama": ("block", 688), "gemma3": ("ckpt", 699)}[runner.engine.loaded.geometry.architecture]
    assert (req.cache.tier, req.cache.warm_tokens) == expected
    assert prefilled == len(ids) + 40 - req.cache.warm_tokens


def test_a_long_prefill_keeps_checkpoints_along_the_way(tiny: dict[str, Path]) -> None:
    r = Runner(tiny["gemma3"], checkpoint_every=256)
    try:
        ids = prompt(900)
        r.run(ids)
        req, _, _ = r.prefilled_by(ids[:600] + prompt(50, salt=4))
        assert (req.cache.tier, req.cache.warm_tokens) == ("ckpt", 512)  # the last checkpoint it shares
    finally:
        r.engine.stop()


def test_a_shared_system_prompt_hits_its_anchor(runner: Runner) -> None:
    system = prompt(300, salt=7)
    runner.run(system + prompt(30, salt=1), anchor=300)
    req, prefilled, _ = runner.prefilled_by(system + prompt(45, salt=2), anchor=300)
    assert (req.cache.tier, req.cache.warm_tokens) == ("anchor", 300) and prefilled == 45


def test_cache_off_means_no_cache(tiny: dict[str, Path]) -> None:
    engine = Engine(lambda: load(tiny["llama"], "float"), "off", prompt_cache=PromptCache(0))
    assert engine.prompt_cache is None


# --- through the server ----------------------------------------------------------------------


def test_estimate_predicts_the_tier_and_metrics_count_it(tiny: dict[str, Path]) -> None:
    body = {
        "messages": [
            {"role": "system", "content": "You are terse. " * 40},
            {"role": "user", "content": "Name a colour."},
        ],
        "max_tokens": 4,
        "temperature": 0,
    }
    other = {**body, "messages": [body["messages"][0], {"role": "user", "content": "Name a number."}]}
    with LiveServer(tiny["llama"]) as server, server.client() as c:
        assert c.post("/v1/estimate", json=body).json()["cache_tier"] == "miss"
        first = c.post("/v1/chat/completions", json=body).json()
        est = c.post("/v1/estimate", json=body).json()
        again = c.post("/v1/chat/completions", json=body).json()
        assert (est["cache_tier"], est["warm_tokens"]) == ("exact", est["prompt_tokens"] - 1)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == est["warm_tokens"]
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        sibling = c.post("/v1/estimate", json=other).json()
        assert sibling["cache_tier"] in ("anchor", "block") and sibling["warm_tokens"] > 100
        snap = c.get("/v1/metrics").json()["server"]["prompt_cache"]
        prom = c.get("/v1/metrics", params={"format": "prometheus"}).text
    assert snap["hits_by_tier"]["exact"] == 1 and snap["misses"] == 1 and snap["bytes"] > 0, snap
    assert 'gmlx_prompt_cache_hits_total{tier="exact"} 1.0' in prom
    assert f"gmlx_prompt_cache_reused_tokens_total {float(snap['reused_tokens'])}" in prom


@pytest.mark.slow
def test_greedy_text_is_the_same_with_and_without_the_cache(default_model: Path) -> None:
    """The default model (sliding layers): a conversation's next turn restores its earlier turn,
    and every answer is the text a server without a cache gives."""
    turn1 = [{"role": "user", "content": "Write two sentences about the sea."}]

    def ask(server: LiveServer, messages: list[dict]) -> dict:
        with server.client() as c:
            r = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 24, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()

    with LiveServer(default_model, prompt_cache_bytes=0) as cold:
        a1 = ask(cold, turn1)["choices"][0]["message"]["content"]
        turn2 = turn1 + [{"role": "assistant", "content": a1}, {"role": "user", "content": "Now one about hills."}]
        a2 = ask(cold, turn2)["choices"][0]["message"]["content"]
    with LiveServer(default_model) as warm:
        assert ask(warm, turn1)["choices"][0]["message"]["content"] == a1
        again = ask(warm, turn1)
        assert again["choices"][0]["message"]["content"] == a1
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == again["usage"]["prompt_tokens"] - 1
        second = ask(warm, turn2)
        assert second["choices"][0]["message"]["content"] == a2
        # The earlier turn's whole cache (its prompt and answer) is the prefix of this one.
        shared = ask_ids_shared(warm, turn1, turn2)
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == shared


def ask_ids_shared(server: LiveServer, turn1: list[dict], turn2: list[dict]) -> int:
    """Tokens the second turn's prompt shares with the first turn's prompt and generated answer."""
    tok = server.engine.loaded.tokenizer
    p1 = tok.encode(
        tok.apply_chat_template(turn1, add_generation_prompt=True, tokenize=False), add_special_tokens=False
    )
    p2 = tok.encode(
        tok.apply_chat_template(turn2, add_generation_prompt=True, tokenize=False), add_special_tokens=False
    )
    answer = tok.encode(turn2[1]["content"], add_special_tokens=False)
    first = p1 + answer
    return next((i for i, (a, b) in enumerate(zip(first, p2)) if a != b), min(len(first), len(p2)))


def test_the_governors_release_drops_the_coldest_entries(tiny: dict[str, Path]) -> None:
    r = Runner(tiny["llama"])
    try:
        r.run(prompt(300))
        first = r.cache.snapshot()["bytes"]
        r.run(prompt(200, salt=1))
        reports: list[tuple[int, int, str]] = []
        # What the governor sends under orange and red: one byte's worth is the coldest entry.
        r.engine.release_memory(
            1, lambda evicted, released: reports.append((evicted, released, threading.current_thread().name))
        )
        r.run(prompt(20, salt=3))  # commands apply in order, so the release happened before this ran
        st = r.cache.snapshot()
        [(evicted, released, thread)] = reports
        assert first > 0 and evicted == first == st["evicted_bytes"] and st["entries"] == 2
        assert r.cache.peek(prompt(300)).tier == "miss" and r.cache.peek(prompt(200, salt=1)).tier == "exact"
        assert released > 0 and thread == "engine-pc"  # MLX's cache went too, on the engine's own thread
    finally:
        r.engine.stop()
