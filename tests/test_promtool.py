"""The Prometheus text as Prometheus' own linter reads it: `promtool check metrics` (Debian's
`prometheus` package; `make system` installs it, CI too) on an idle server and on a busy one, a
stream decoding and a request queued. The same families in both, and OpenMetrics when asked."""

from __future__ import annotations

import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import LiveServer
from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
from prometheus_client.parser import text_string_to_metric_families
from tiny_models import write_model

from gmlx.server.metrics import snapshot
from gmlx.server.prometheus import content_type

pytestmark = pytest.mark.skipif(
    shutil.which("promtool") is None, reason="promtool is not installed (Debian's prometheus package: make system)"
)
VLLM = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:cache_config_info")
OPENMETRICS = "application/openmetrics-text; version=1.0.0"


def promtool(text: str) -> list[str]:
    """The problems promtool reports (none: it exits 0; lint problems: it exits 3)."""
    done = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    problems = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert done.returncode == (3 if problems else 0), (done.returncode, problems)
    return problems


def families(text: str) -> dict[str, dict[tuple, float]]:
    return {
        f.name: {(s.name, tuple(sorted(s.labels.items()))): s.value for s in f.samples}
        for f in text_string_to_metric_families(text)
    }


def scrape(c: httpx.Client) -> tuple[str, str]:
    """/v1/metrics?format=prometheus and /metrics, each checked by promtool: the first with no
    problem at all, the second with only the ':' of vLLM's names, which routers read as they are."""
    own = c.get("/v1/metrics", params={"format": "prometheus"}).text
    router = c.get("/metrics").text
    assert promtool(own) == []
    assert sorted(promtool(router)) == sorted(f"{name} metric names should not contain ':'" for name in VLLM)
    return own, router


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """One slot and one queue place: a held stream decodes, a second request waits."""
    path = write_model(tmp_path_factory.mktemp("promtool") / "long.gguf", "llama", context=32768)
    with LiveServer(path, decode_batch=1, queue_size=1, governor=False) as server:
        yield server


def test_idle_and_busy_text_pass_promtool_with_the_same_families(server: LiveServer) -> None:
    model = server.model_id
    eos = {str(t): -100 for t in server.engine.loaded.tokenizer.eos_token_ids}
    holder = {"prompt": "the sea " * 20, "max_tokens": 30_000, "stream": True, "logit_bias": eos}
    answers: list[httpx.Response] = []
    with server.client() as c:
        idle, idle_router = scrape(c)
        with c.stream("POST", "/v1/completions", json=holder) as s:
            lines = s.iter_lines()  # kept: a dropped iterator closes the stream
            next(lines)  # it holds the one slot and decodes
            waiter = threading.Thread(
                target=lambda: answers.append(
                    server.client().post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
                )
            )
            waiter.start()
            server.wait_until(lambda: server.model.gate.waiting == 1)
            refused = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})  # the queue is full
            busy, busy_router = scrape(c)
        waiter.join(30)
    assert refused.status_code == 503 and answers[0].status_code == 200
    before, during = families(idle), families(busy)
    # Every family is declared from the first scrape: none appears only under load.
    assert set(before) == set(during) and set(families(idle_router)) == set(families(busy_router))
    assert set(families(busy_router)) - set(during) == set(VLLM)
    rejected = ("gmlx_queue_rejections_total", (("reason", "queue_full"),))
    assert before["gmlx_queue_rejections"][rejected] == 0 and during["gmlx_queue_rejections"][rejected] == 1
    for name, labels in (
        ("gmlx_rates_decode_tokens_per_second", ()),
        ("gmlx_model_decode_tokens_per_second", (("model", model),)),
    ):
        assert before[name][(name, labels)] == 0  # idle reads 0, not absent
        assert during[name][(name, labels)] > 0
    rows = {dict(labels)["state"]: n for (_, labels), n in during["gmlx_requests"].items()}
    assert rows == {"queued": 1, "prefill": 0, "decode": 1}
    [((_, labels), value)] = during["gmlx_config_info"].items()  # one series: the configuration as its labels
    assert value == 1 and dict(labels)["governor_enabled"] == "false" and dict(labels)["prefill_step"].isdigit()
    [((_, labels), value)] = during["gmlx_model_info"].items()  # and each model's
    assert value == 1 and dict(labels)["decode_batch"] == "1" and dict(labels)["model"] == model
    # Each resident model's histograms are there before its first request, at 0.
    for name in ("gmlx_ttft_seconds", "gmlx_e2e_request_latency_seconds", "gmlx_queue_wait_seconds"):
        assert before[name][(f"{name}_count", (("model", model),))] == 0


def test_openmetrics_when_the_accept_header_asks(server: LiveServer) -> None:
    """The same families in OpenMetrics text (one `# EOF`, vLLM's names unchanged), parsed by the
    OpenMetrics parser; any other Accept gets the classic text."""
    histograms = server.state.histograms
    snap = snapshot(server.state)
    classic = {  # less the histograms' creation times, which the classic parser reads as families of their own
        f.name
        for f in text_string_to_metric_families(histograms.render(snap, router=server.model_id).decode())
        if not f.name.endswith("_created")
    }
    text = histograms.render(snap, router=server.model_id, accept=f"{OPENMETRICS}, text/plain;q=0.5").decode()
    assert text.endswith("# EOF\n") and text.count("# EOF") == 1
    parsed = {f.name: f for f in openmetrics_families(text)}
    assert {*parsed} | {"gmlx_config_info", "gmlx_model_info"} == classic | {"gmlx_config", "gmlx_model"}
    assert parsed["gmlx_config"].type == "info" and parsed["gmlx_queue_rejections"].type == "counter"
    assert [s.name for s in parsed["vllm:num_requests_running"].samples] == ["vllm:num_requests_running"]
    assert content_type(OPENMETRICS).startswith("application/openmetrics-text; version=1.0.0")
    assert content_type("text/plain").startswith("text/plain") and content_type(None).startswith("text/plain")


def test_two_resident_models_each_have_their_series(tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    """With a second model loaded on demand, promtool still passes (no series twice) and every
    per-model family has a series for each model."""
    folder = tmp_path / "models"
    folder.mkdir()
    write_model(folder / "other.gguf", "qwen3", seed=3)
    with LiveServer(tiny_models["llama"], models_dir=str(folder)) as server, server.client() as c:
        for model in (None, "other"):
            body = {"prompt": "hello", "max_tokens": 3} | ({"model": model} if model else {})
            assert c.post("/v1/completions", json=body).status_code == 200
        own, _ = scrape(c)
    by_model: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(own):
        for s in family.samples:
            if "model" in s.labels:
                by_model.setdefault(family.name, set()).add(s.labels["model"])
    for name in ("gmlx_ttft_seconds", "gmlx_e2e_request_latency_seconds", "gmlx_model_in_flight", "gmlx_requests"):
        assert by_model[name] == {server.model_id, "other"}, name
    assert by_model["gmlx_capacity_max_context_tokens"] == {server.model_id, "other"}
    ttft = families(own)["gmlx_ttft_seconds"]
    assert ttft[("gmlx_ttft_seconds_count", (("model", "other"),))] == 1
