"""Many models on one server: each on its own engine, loaded on demand under one memory budget,
unloaded when idle, and every route answering per model."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from conftest import LiveServer, invoke, invoke_json
from tiny_models import write_model

CHAT = "/v1/chat/completions"
# A stream that runs to max_tokens: the tiny models' end tokens (<eos>, <end_of_turn>) are banned.
LONG = {"prompt": "x", "max_tokens": 12000, "temperature": 0, "stream": True, "logit_bias": {"1": -100, "5": -100}}


def ask(model: str | None, max_tokens: int = 4, **extra: object) -> dict:
    body: dict = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": max_tokens, "temperature": 0}
    return body | ({"model": model} if model else {}) | extra


@pytest.fixture
def folder(tmp_path: Path, tiny_models: dict[str, Path]) -> Path:
    """The preloaded model's twin (the same file under another name), and a tiny model of another
    architecture and tokenizer."""
    root = tmp_path / "models"
    root.mkdir()
    shutil.copy(tiny_models["llama"], root / "twin.gguf")
    write_model(root / "other.gguf", "qwen3", seed=3)
    return root


class SlowLoads:
    """A build whose engines wait for `release` before loading, so a test sees `loading`."""

    def __init__(self, *slow: str):
        from gmlx.server.build import build_engine

        self.slow, self.release, self._build = set(slow), threading.Event(), build_engine

    def __call__(self, d, others_bytes: int):
        engine = self._build(d, others_bytes)
        if d.model_id in self.slow:
            load = engine._load
            engine._load = lambda: (self.release.wait(60), load())[1]
        return engine


async def settle(predicate: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """Wait for a server state; fail naming it rather than hang when it never comes."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, f"never saw {what} in {timeout:.0f} s"
        await asyncio.sleep(0.01)


def statuses(c: httpx.Client) -> dict[str, str]:
    return {m["id"]: m["status"] for m in c.get("/v1/models").json()["data"]}


def test_each_model_answers_its_own_requests_concurrently(tiny_models: dict[str, Path], folder: Path) -> None:
    with LiveServer(tiny_models["llama"], models_dir=str(folder)) as server, server.client() as c:
        assert statuses(c) == {"tiny-llama": "loaded", "other": "unloaded", "twin": "unloaded"}

        async def run() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as ac:
                bodies = [ask(m, 6) for m in ("other", None, "twin", "other", "tiny-llama", "twin")]
                return await asyncio.gather(*(ac.post(CHAT, json=b) for b in bodies))

        answers = asyncio.run(run())
        assert [r.status_code for r in answers] == [200] * 6, [r.text for r in answers]
        by = [r.json()["model"] for r in answers]
        assert by == ["other", "tiny-llama", "twin", "other", "tiny-llama", "twin"]
        text = [r.json()["choices"][0]["message"]["content"] for r in answers]
        assert text[1] == text[2] == text[4] == text[5]  # the twin is the same weights: the same greedy text
        assert text[0] == text[3] != text[1]  # another model, another answer
        assert statuses(c) == {"tiny-llama": "loaded", "other": "loaded", "twin": "loaded"}
        # Each engine counted its own requests; the rows and totals carry them all.
        finished = {mid: sum(m.stats.finish_reasons.values()) for mid, m in server.state.models.items()}
        assert finished == {"tiny-llama": 2, "other": 2, "twin": 2}
        snap = c.get("/v1/metrics").json()["server"]
        resident = {m["model"]: m for m in snap["resident_models"]}
        assert set(resident) == {"tiny-llama", "other", "twin"}
        assert all(m["status"] == "loaded" and m["load_seconds"] > 0 and m["capacity"] for m in resident.values())
        assert sum(snap["totals"]["requests_finished"].values()) == 6
        assert {m["id"]: m["max_context_at_width_1"] is not None for m in c.get("/v1/models").json()["data"]} == {
            "tiny-llama": True,
            "other": True,
            "twin": True,
        }
        system = c.get("/system").json()["models"]
        assert system["active"] == "tiny-llama" and set(system["loaded"]) == {"tiny-llama", "other", "twin"}
        assert all("/" not in m["name"] for m in system["available"])  # ids, never paths


def test_statuses_move_and_requests_wait_while_their_model_loads(tiny_models: dict[str, Path], folder: Path) -> None:
    slow = SlowLoads("other")
    with LiveServer(tiny_models["llama"], build=slow, models_dir=str(folder)) as server, server.client() as c:
        answers: list[httpx.Response] = []
        waiting = threading.Thread(target=lambda: answers.append(c.post(CHAT, json=ask("other"))), daemon=True)
        waiting.start()
        other = server.state.models["other"]
        server.wait_until(lambda: other.gate.waiting == 1)
        assert statuses(c)["other"] == "loading"
        rows = [r for r in c.get("/v1/metrics").json()["server"]["requests"] if r["model"] == "other"]
        assert [(r["state"], r["prompt_tokens"]) for r in rows] == [("queued", None)]  # its tokenizer comes with it
        ready = c.get("/health", params={"ready": 1})
        assert ready.status_code == 200  # another model can take work meanwhile
        assert c.post(CHAT, json=ask(None)).status_code == 200  # and does
        slow.release.set()
        waiting.join(60)
        assert answers[0].status_code == 200 and answers[0].json()["model"] == "other"
        assert statuses(c)["other"] == "loaded"
        unloaded = c.post("/v1/models/other/unload")
        assert unloaded.status_code == 200 and unloaded.json()["status"] == "unloaded"
        assert statuses(c)["other"] == "unloaded"
        again = c.post("/v1/models/other/unload")
        assert again.status_code == 404 and again.json()["error"]["code"] == "model_not_loaded"
        loaded = c.post("/v1/models/other/load")
        assert loaded.status_code == 200 and loaded.json()["status"] == "loaded"


def _one_model_memory(path: Path) -> int:
    """Memory that holds one of two same-sized models with a stream of the useful depth, never both
    (no governor: the arithmetic alone decides)."""
    from gmlx.deployment import Deployment
    from gmlx.server.residency import USEFUL_DEPTH
    from gmlx.settings import resolve_settings

    def fits(memory: int, others: int) -> bool:
        s = resolve_settings({"memory": memory, "weights": "float", "decode_batch": 4, "governor": False}, env={})
        table = Deployment("m", path, s).planned_table(others)[0]
        return table.max_context_at_width(1) >= min(USEFUL_DEPTH, table.context_length)

    def least(others: int) -> int:
        lo, hi = 2**20, 2**40
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if fits(mid, others) else (mid + 1, hi)
        return lo

    s = resolve_settings({"weights": "float", "governor": False}, env={})
    weights = Deployment("m", path, s).planned_weight_bytes
    alone, both = least(0), least(weights)
    assert both > alone
    return (alone + both) // 2


def test_a_memory_for_one_model_swaps_them_only_when_idle(tmp_path: Path) -> None:
    folder = tmp_path / "models"
    folder.mkdir()
    main = write_model(tmp_path / "main.gguf", "llama", context=16384)
    shutil.copy(main, folder / "twin.gguf")
    memory = _one_model_memory(main)
    slow = SlowLoads("twin")
    with (
        LiveServer(main, build=slow, models_dir=str(folder), memory=memory, governor=False) as server,
        server.client() as c,
    ):
        first, twin = server.model, server.state.models["twin"]

        async def swap() -> tuple[httpx.Response, httpx.Response, httpx.Response]:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as ac:
                # A stream on the first model keeps it busy: the twin cannot take its place.
                async with ac.stream("POST", "/v1/completions", json=LONG) as stream:
                    async for _ in stream.aiter_lines():
                        break
                    refused = await ac.post(CHAT, json=ask("twin"))
                # Idle once its engine has dropped the stream too (the gate frees its slot first): the twin's
                # load unloads it; a second request for the twin waits meanwhile.
                await settle(lambda: first.idle, "the first model idle")
                loading = asyncio.create_task(ac.post(CHAT, json=ask("twin")))
                await settle(lambda: twin.status == "loading" or loading.done(), "the twin loading")
                assert not loading.done(), loading.result().text
                during = asyncio.create_task(ac.post(CHAT, json=ask("twin")))
                await settle(lambda: twin.gate.waiting >= 2, "two requests waiting for the twin")
                slow.release.set()
                return refused, await loading, await during

        refused, loaded, during = asyncio.run(swap())
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "model_unavailable"
        assert "busy" in refused.json()["error"]["message"] and int(refused.headers["Retry-After"]) > 0
        assert loaded.status_code == during.status_code == 200
        assert statuses(c) == {"main": "unloaded", "twin": "loaded"}
        # The estimate for the unloaded first model says what its load would unload.
        estimate = c.post("/v1/estimate", json=ask("main")).json()
        assert estimate["resident"] is False and estimate["loadable"] is True and estimate["evicts"] == ["twin"]
        # And asking for it swaps back.
        assert c.post(CHAT, json=ask(None)).json()["model"] == "main"
        assert statuses(c)["twin"] == "unloaded"
        # A request readying for the gate (tokenizing, say) keeps its model as a running one does.
        first.pins += 1
        try:
            assert c.post(CHAT, json=ask("twin")).json()["error"]["code"] == "model_unavailable"
            # The capacity routes say so too, not that a request would load it.
            plan = c.get("/v1/capacity/plan", params={"width": 1, "depth": 16, "model": "twin"}).json()
            estimate = c.post("/v1/estimate", json=ask("twin")).json()
        finally:
            first.pins -= 1
        assert plan["admit_now"] is False and "nor loadable now" in plan["reason"]
        assert estimate["loadable"] is False and estimate["evicts"] == [] and "cannot load now" in estimate["note"]


def test_the_plan_beside_another_model_is_the_offline_plan_beside_it(
    tiny_models: dict[str, Path], folder: Path, no_settings_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GMLX_GOVERNOR", "0")  # the CLI's settings, as the server's below
    memory = 3 * 2**30
    offline = invoke_json(
        "plan",
        folder / "other.gguf",
        "--beside",
        tiny_models["llama"],
        "--memory",
        memory,
        "--weights",
        "float",
        "--decode-batch",
        4,
        "--width",
        2,
        "--depth",
        256,
    )
    assert offline["assumptions"]["other_models_bytes"]["value"] > 0
    with (
        LiveServer(tiny_models["llama"], models_dir=str(folder), memory=memory, governor=False) as server,
        server.client() as c,
    ):
        query = {"model": "other", "width": 2, "depth": 256}
        before = c.get("/v1/capacity/plan", params=query).json()
        assert c.post("/v1/models/other/load").status_code == 200
        after = c.get("/v1/capacity/plan", params=query).json()
        default = c.get("/v1/capacity/plan", params={"width": 2, "depth": 256}).json()
    for key in ("ok", "max_context_at_width", "max_width_at_depth", "model"):
        assert before[key] == offline["plan"][key] == after[key], key
    assert before["admit_now"] is True and before["reason"] == "ok"  # a request loads it now, and waits
    assert after["admit_now"] is True and default["model"] == "tiny-llama"


def test_both_engines_decode_at_once_and_a_load_stalls_neither(tmp_path: Path, folder: Path) -> None:
    slow = SlowLoads("other")
    long = write_model(tmp_path / "long.gguf", "llama", context=16384)  # a stream that outlasts the load
    with LiveServer(long, build=slow, models_dir=str(folder)) as server:
        first, other = server.model, server.state.models["other"]

        def generated() -> int:
            return sum(r.generated for r in first.engine.requests())

        async def run() -> tuple[int, bool, int]:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as ac:
                streaming = asyncio.create_task(ac.post("/v1/completions", json={**LONG, "stream": False}))
                while first.engine.decoding < 1:
                    await asyncio.sleep(0.005)
                loading = asyncio.create_task(
                    ac.post("/v1/completions", json={**LONG, "model": "other", "max_tokens": 200})
                )
                while other.status != "loading":
                    await asyncio.sleep(0.005)
                before = generated()
                await asyncio.sleep(1.0)  # the first model decodes on while the other loads
                during = generated() - before
                slow.release.set()
                both = False
                while not both and not streaming.done():
                    both = other.engine is not None and other.engine.decoding == 1 and first.engine.decoding == 1
                    await asyncio.sleep(0.002)
                await ac.post(f"/v1/models/{server.model_id}/unload")  # refused: it is busy
                return during, both, (await loading).status_code if both else 0

        during, both, status = asyncio.run(run())
        assert during > 20  # tokens in the second the other model spent loading
        assert both and status == 200  # two batches on two threads, at the same moment


def test_bad_model_input(folder: Path, tmp_path: Path) -> None:
    good = write_model(tmp_path / "broken.gguf", "llama")
    (folder / "broken.gguf").write_bytes(good.read_bytes()[: good.stat().st_size // 2])  # its header, half its data
    long = write_model(tmp_path / "long.gguf", "llama", context=16384)
    with LiveServer(long, models_dir=str(folder)) as server, server.client() as c:
        unknown = c.post(CHAT, json=ask("nowhere"))
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
        assert str(folder) not in unknown.text and "/" not in unknown.json()["error"]["message"].split("(")[0]
        assert c.get("/v1/models/nowhere").status_code == 404
        assert c.post("/v1/models/nowhere/load").status_code == 404
        assert c.post("/v1/models/twin/unload").json()["error"]["code"] == "model_not_loaded"
        broken = c.post(CHAT, json=ask("broken"))
        assert broken.status_code == 503 and broken.json()["error"]["code"] == "model_unavailable"
        assert broken.headers["Retry-After"] == "60"  # not tried again until the file changes
        plan = c.get("/v1/capacity/plan", params={"width": 1, "depth": 16, "model": "broken"})
        assert plan.status_code == 404 and plan.json()["error"]["code"] == "model_not_found"  # not a 500
        entry = c.get("/v1/models/broken").json()
        assert entry["status"] == "unloaded" and "truncated" in entry["load_error"]
        assert str(folder) not in entry["load_error"]  # the file's name, not where it lives
        again = c.post(CHAT, json=ask("broken"))  # the same file is not loaded again
        assert again.status_code == 503 and "failed to load" in again.json()["error"]["message"]
        assert c.post(CHAT, json=ask(None)).status_code == 200  # the others keep serving
        long.unlink()  # its weights are in memory: it serves on without its file
        assert c.post(CHAT, json=ask(None)).status_code == 200
        assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4}).status_code == 200
        server.model.pins += 1  # a request readying for its slot: the model is busy
        try:
            refused = c.post(f"/v1/models/{server.model_id}/unload")
        finally:
            server.model.pins -= 1
        error = refused.json()["error"]
        assert refused.status_code == 409 and (error["code"], error["type"]) == ("model_busy", "invalid_request_error")


def test_keep_alive_and_max_resident(tiny_models: dict[str, Path], folder: Path) -> None:
    with (
        LiveServer(tiny_models["llama"], models_dir=str(folder), keep_alive="3s", max_resident=2) as server,
        server.client() as c,
    ):

        def prompt_cache() -> dict:
            return c.get("/v1/metrics").json()["server"]["prompt_cache"]

        assert c.post(CHAT, json=ask(None)).status_code == 200
        assert c.post(CHAT, json=ask(None)).status_code == 200  # its prompt, from the preloaded model's cache
        counted = prompt_cache()
        assert counted["hits"] >= 1 and counted["misses"] >= 1
        assert c.post(CHAT, json=ask("other")).status_code == 200
        assert c.post(CHAT, json=ask("twin")).status_code == 200  # two at most: the oldest idle one made room
        assert {m for m, s in statuses(c).items() if s == "loaded"} == {"other", "twin"}
        system = c.get("/system").json()  # the model it names is one that is loaded, whose compute type it gives
        assert system["model"] == system["models"]["active"] and system["model"] in {"other", "twin"}
        # The series a router reads keep one identity, the preloaded model's, whatever is resident.
        router_series = f'vllm:kv_cache_usage_perc{{model_name="{server.model_id}"}}'
        assert router_series in c.get("/metrics").text
        # Idle past the keep-alive, every model is unloaded, the preloaded one too.
        server.wait_until(lambda: set(statuses(c).values()) == {"unloaded"}, timeout=20)
        # It still takes work (a load balancer that heard "loading" would never send what loads it).
        ready = c.get("/health", params={"ready": 1})
        assert ready.status_code == 200 and ready.json()["ready"] is True
        assert c.get("/system").json()["state"] == "unloaded"
        plan = c.get("/v1/capacity/plan", params={"width": 1, "depth": 64}).json()  # a balancer's plan check agrees
        assert plan["admit_now"] is True and plan["ok"] is True
        offered = c.get("/v1/metrics").json()["server"]["concurrency"]  # what the next request loads offers
        assert offered["decode_batch"] == server.model.gate.width and offered["queue_cap"] == server.model.gate.cap
        usage = [line for line in c.get("/metrics").text.splitlines() if line.startswith("vllm:kv_cache_usage_perc")]
        assert len(usage) == 1 and usage[0].startswith(router_series)
        assert float(usage[0].split()[-1]) < 0.5  # not 1.0, which a router reads as saturated
        unloaded = prompt_cache()  # empty, its counters as they stood: Prometheus counters never fall
        assert unloaded["enabled"] and (unloaded["bytes"], unloaded["entries"]) == (0, 0)
        assert {k: unloaded[k] for k in ("hits", "misses", "stored_bytes")} == {
            k: counted[k] for k in ("hits", "misses", "stored_bytes")
        }
        assert c.post(CHAT, json=ask(None)).status_code == 200  # and loads again when asked for
        assert c.get("/system").json()["state"] == "ready"
        again = prompt_cache()
        assert again["misses"] == counted["misses"] + 1 and again["hits"] == counted["hits"]  # a fresh cache


def test_keep_alive_counts_from_the_end_of_the_last_request(tmp_path: Path) -> None:
    """A model is idle from when its last request ended, not from when it arrived: one that ran
    longer than the keep-alive was unloaded within a second of its end."""
    path = write_model(tmp_path / "long.gguf", "llama", context=16384)
    with LiveServer(path, keep_alive="3s") as server, server.client() as c:

        async def four_seconds() -> None:  # then the client leaves, and the request ends
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as ac:
                request = asyncio.create_task(ac.post("/v1/completions", json={**LONG, "stream": False}))
                await asyncio.sleep(4)
                assert not request.done()
                request.cancel()
                await asyncio.gather(request, return_exceptions=True)

        asyncio.run(four_seconds())
        server.wait_until(lambda: not server.model.gate.running)
        time.sleep(1.5)
        assert statuses(c)[server.model_id] == "loaded"
        server.wait_until(lambda: statuses(c)[server.model_id] == "unloaded", timeout=20)


def test_presets_give_a_model_its_own_id_and_settings(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    preset = tmp_path / "presets.toml"
    preset.write_text(
        f'[models.small]\npath = "{tiny_models["qwen3"]}"\ndecode-batch = 2\nmax_kv_size = 128\n'
        f'[models.main]\npath = "{tiny_models["llama"]}"\n'
    )
    with LiveServer(tiny_models["llama"], models_preset=str(preset)) as server, server.client() as c:
        assert server.model_id == "main"  # the positional file keeps its preset's id
        unloaded = c.get("/v1/models/small").json()  # a harness sizes its prompts by it before the first request
        assert (unloaded["status"], unloaded["context_length"]) == ("unloaded", 128)
        assert c.post(CHAT, json=ask("small")).status_code == 200
        loaded = c.get("/v1/models/small").json()
        assert loaded["status"] == "loaded" and loaded["created"] == unloaded["created"]  # one model, one date
        small = c.get("/v1/models/small").json()
        assert small["context_length"] == 128 and small["source"] == "preset"
        resident = {m["model"]: m for m in c.get("/v1/metrics").json()["server"]["resident_models"]}
        assert resident["small"]["decode_batch"] == 2 and resident["main"]["decode_batch"] == 4
        too_many = c.post(CHAT, json=ask("small", n=3))
        assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('[models.a]\npath = "{model}"\ncolour = 1\n', "unknown key(s): colour"),
        ('[models.a]\npath = "{missing}"\n', "is not a file"),
        ('[models.a]\npath = "{model}"\nport = 9\n', "unknown key(s): port"),
        ('[models.a]\npath = "{model}"\ndecode_batch = 0\n', "decode_batch: 0 from preset 'a' must be >= 1"),
        ('[models.a]\npath = "{model}"\ndecode_batch = 2\ndecode-batch = 5\n', "a key is given twice"),
    ],
)
def test_a_bad_presets_file_is_one_line_and_exit_2(
    tiny_models: dict[str, Path], tmp_path: Path, text: str, expected: str, no_settings_env: None
) -> None:
    preset = tmp_path / "presets.toml"
    preset.write_text(text.format(model=tiny_models["llama"], missing=tmp_path / "nope.gguf"))
    r = invoke("serve", tiny_models["llama"], "--models-preset", preset, "--port", 0)
    assert r.exit_code == 2, r.output
    assert expected in r.output and len(r.output.strip().splitlines()) == 1, r.output


def test_a_preset_whose_file_is_no_gguf_fails_at_start(
    tiny_models: dict[str, Path], tmp_path: Path, no_settings_env: None
) -> None:
    """As the positional file does (exit 3), not later as a 503 telling clients to retry."""
    (tmp_path / "notes.gguf").write_text("hello")
    preset = tmp_path / "presets.yaml"
    preset.write_text("models:\n  notes:\n    path: notes.gguf\n")
    r = invoke("serve", tiny_models["llama"], "--models-preset", preset, "--port", 0)
    assert r.exit_code == 3 and "notes.gguf" in r.output and "Traceback" not in r.output, r.output
    preset.write_text(f"models:\n  1:\n    path: {tiny_models['llama']}\n")  # YAML reads the id as a number
    r = invoke("serve", tiny_models["llama"], "--models-preset", preset, "--port", 0)
    assert r.exit_code == 2 and "an id must be a non-empty string" in r.output, r.output


def test_a_preset_id_that_is_a_folder_files_name_is_refused(
    tiny_models: dict[str, Path], folder: Path, tmp_path: Path, no_settings_env: None
) -> None:
    """The folder's twin.gguf would be hidden behind a preset of that id naming another file:
    `gmlx serve` refuses it at start (exit 2, this error's one line)."""
    from gmlx.deployment import deployments
    from gmlx.presets import load_presets
    from gmlx.server.system import models_dir_files
    from gmlx.settings import SettingsError, resolve_settings

    preset = tmp_path / "presets.toml"
    preset.write_text(f'[models.twin]\npath = "{folder / "other.gguf"}"\n')
    with pytest.raises(SettingsError, match="model id 'twin' names two files"):
        deployments(resolve_settings({}), tiny_models["llama"], load_presets(preset), models_dir_files(str(folder)))


def test_models_json_lists_presets_and_folder(tiny_models: dict[str, Path], folder: Path, tmp_path: Path) -> None:
    preset = tmp_path / "presets.yaml"
    preset.write_text(json.dumps({"models": {"named": {"path": str(folder / "other.gguf")}}}))
    with (
        LiveServer(tiny_models["llama"], models_dir=str(folder), models_preset=str(preset)) as server,
        server.client() as c,
    ):
        ids = [m["id"] for m in c.get("/v1/models").json()["data"]]
        # The folder's other.gguf is the preset's `named`, listed once.
        assert ids == ["tiny-llama", "named", "twin"]
        (folder / "late.gguf").write_bytes((folder / "twin.gguf").read_bytes())
        assert c.post(CHAT, json=ask("late")).json()["model"] == "late"  # a file added since start


def test_orange_unloads_an_idle_model_after_the_prompt_caches(tiny_models: dict[str, Path], folder: Path) -> None:
    from gmlx.server.memory_governor import MemoryReading

    with (
        LiveServer(tiny_models["llama"], models_dir=str(folder), governor_interval_s=0.02) as server,
        server.client() as c,
    ):
        assert c.post(CHAT, json=ask("other")).status_code == 200  # the preloaded model is now the older
        governor, real = server.state.governor, server.state.governor.probe
        budget = server.model.table().budget
        limit = budget.total_bytes - budget.reserve_bytes
        governor.probe = lambda: MemoryReading(int(0.95 * limit), 0, 0, limit)  # orange, whatever runs
        server.wait_until(lambda: len(server.state.resident()) == 1, timeout=10)
        governor.probe = real
        assert statuses(c) == {"tiny-llama": "unloaded", "other": "loaded", "twin": "unloaded"}
        actions = c.get("/v1/metrics").json()["server"]["governor"]["actions"]
        assert (
            actions["unload_model"]["count"] >= 1
            and actions["evict_prompt_cache"]["count"] + actions["clear_cache"]["count"] >= 1
        )  # the caches were released first
