"""`gmlx plan` and `gmlx estimate`: offline from the header, and the same answers from a live server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import LiveServer, MiB, invoke, invoke_json, kv_float_bytes, offline_table

pytestmark = pytest.mark.usefixtures("no_settings_env")
PLAN_FIELDS = [
    "width",
    "depth",
    "ok",
    "max_context_at_width",
    "max_width_at_depth",
    "model",
    "band",
    "decode_batch",
    "in_flight",
    "waiting",
    "slots",
    "admit_now",
    "reason",
]
SAME_AS_SERVER = ("ok", "max_context_at_width", "max_width_at_depth")


def one_line_error(r, code: int = 2) -> str:
    assert r.exit_code == code, r.output
    assert r.stderr.startswith("error:") and len(r.stderr.strip().splitlines()) == 1, r.stderr
    return r.stderr


def test_plan_ok(tiny_models: dict[str, Path]) -> None:
    out = invoke_json("plan", tiny_models["llama"], "--width", 2, "--depth", 128, "--memory", "8GiB")
    p, a = out["plan"], out["assumptions"]
    assert list(p) == PLAN_FIELDS
    assert p["ok"] is True and p["admit_now"] is True and p["reason"] == "ok" and p["model"] == "tiny-llama"
    assert p["max_context_at_width"] == 256 and p["max_width_at_depth"] == 8 == p["decode_batch"] == p["slots"]
    assert p["in_flight"] == p["waiting"] == 0 and p["band"] is None
    assert a["source"] == "offline" and a["memory_bytes"] == {"value": 8 * 2**30, "from": "--memory"}
    float_name = {2: "float16", 4: "float32"}[kv_float_bytes()]  # float16 where the kernels run attention
    assert a["kv_format"]["element_bytes"] == kv_float_bytes() and a["kv_format"]["from"].startswith(float_name)
    assert a["decode_batch"] == {"value": 8, "from": "default"} and a["prefill_step"]["value"] == 512
    assert a["weights"]["value"] in ("float", "native") and a["weights"]["resident_bytes"] > 0
    assert a["reserve_bytes"]["value"] == int(0.1 * 8 * 2**30)

    r = invoke("plan", tiny_models["llama"], "--width", 2, "--depth", 128)
    assert r.exit_code == 0, r.output
    assert "admit_now" in r.stdout and "assumptions" in r.stdout and "system memory" in r.stdout


def test_plan_not_ok(tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    llama = tiny_models["llama"]
    past = invoke_json("plan", llama, "--width", 1, "--depth", 300, "--memory", "8GiB", code=1)["plan"]
    assert past["ok"] is False and past["admit_now"] is False
    assert past["reason"] == "depth 300 exceeds max context 256 at width 1" and past["max_width_at_depth"] == 0
    # 512 MiB is all reserve: no room for one token.
    starved = invoke_json("plan", llama, "--width", 1, "--depth", 1, "--memory", "512MiB", code=1)["plan"]
    assert starved["reason"] == "depth 1 exceeds max context 0 at width 1"
    r = invoke("plan", llama, "--width", 1, "--depth", 1, "--memory", "512MiB")
    assert r.exit_code == 1 and "exceeds max context 0" in r.stdout
    # The server's environment variables count, as they do for `gmlx serve`.
    monkeypatch.setenv("GMLX_MEMORY", "512MiB")
    a = invoke_json("plan", llama, "--width", 1, "--depth", 1, code=1)["assumptions"]
    assert a["memory_bytes"] == {"value": 512 * MiB, "from": "env GMLX_MEMORY"}


def test_plan_table(tiny_models: dict[str, Path]) -> None:
    out = invoke_json("plan", tiny_models["gemma3"], "--table", "--memory", "8GiB", "--decode-batch", 3)
    t = out["table"]
    assert t["widths"] == {"1": 256, "2": 256, "3": 256} and t["depths"] == {"256": 3}
    assert (
        t["decode_batch"] == 3
        and t["kv_format"]["float_bytes"] == kv_float_bytes()
        and t["headline"].startswith("capacity:")
    )
    assert out["assumptions"]["decode_batch"] == {"value": 3, "from": "--decode-batch"}
    r = invoke("plan", tiny_models["gemma3"], "--table", "--memory", "8GiB")
    assert r.exit_code == 0, r.output
    assert "capacity: 8 streams of 256 tokens" in r.stdout and "max context" in r.stdout and "max width" in r.stdout


def test_plan_with_max_kv_size(tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    llama = tiny_models["llama"]  # trained window: 256
    out = invoke_json("plan", llama, "--table", "--memory", "8GiB", "--max-kv-size", 100)
    assert out["table"]["context_length"] == 100 and set(out["table"]["widths"].values()) == {100}
    assert out["table"]["depths"] == {"100": 8}
    assert out["assumptions"]["context_length"] == {"value": 100, "from": "--max-kv-size, below the GGUF's 256"}
    p = invoke_json("plan", llama, "--width", 1, "--depth", 101, "--memory", "8GiB", "--max-kv-size", 100, code=1)
    assert p["plan"]["reason"] == "depth 101 exceeds max context 100 at width 1"
    monkeypatch.setenv("GMLX_MAX_KV_SIZE", "4096")  # above the trained window: no effect
    a = invoke_json("plan", llama, "--width", 1, "--depth", 256, "--memory", "8GiB")["assumptions"]
    assert a["context_length"] == {"value": 256, "from": "the GGUF header (env GMLX_MAX_KV_SIZE 4096 is not smaller)"}
    est = invoke_json("estimate", llama, "--prompt", "word " * 60, "--max-kv-size", 50, code=1)["estimate"]
    assert est["context_limit"] == 50 and est["prompt_tokens"] >= 50 and est["context_ok"] is False


@pytest.mark.parametrize(
    "args", [["--width", 0, "--depth", 5], ["--width", 2, "--depth", -1], ["--width", "x", "--depth", 5]]
)
def test_plan_bad_numbers_are_usage_errors(tiny_models: dict[str, Path], args: list) -> None:
    assert invoke("plan", tiny_models["llama"], *args).exit_code == 2


def test_plan_errors_exit_2(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    llama = tiny_models["llama"]
    assert "--width and --depth are required" in one_line_error(invoke("plan", llama, "--width", 2))
    assert "not a memory size" in one_line_error(invoke("plan", llama, "--width", 1, "--depth", 1, "--memory", "lots"))
    assert "decode_batch" in one_line_error(invoke("plan", llama, "--table", "--decode-batch", 0))
    (tmp_path / "bad.gguf").write_bytes(b"not a model")
    one_line_error(invoke("plan", tmp_path / "bad.gguf", "--width", 1, "--depth", 1))
    assert "no such file" in one_line_error(invoke("plan", tmp_path / "nope.gguf", "--width", 1, "--depth", 1))
    assert "cannot reach" in one_line_error(invoke("plan", "--url", "http://127.0.0.1:9", "--width", 1, "--depth", 1))


def test_plan_reads_the_config_file_serve_reads(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    config = tmp_path / "gmlx.toml"
    config.write_text("decode-batch = 4\nmax_kv_size = 128\n")
    table = invoke_json("plan", tiny_models["llama"], "--table", "--config", config)["table"]
    assert table["decode_batch"] == 4 and table["context_length"] == 128  # serve --config's, not the defaults
    assert "--config" in one_line_error(invoke("plan", "--url", "http://127.0.0.1:9", "--table", "--config", config))


def test_flags_that_cannot_apply_are_usage_errors(tiny_models: dict[str, Path]) -> None:
    """With --url the server's settings answer, so an offline flag would be ignored; --model names a
    served model, so offline it would be. Each is refused before anything is asked or read."""
    llama, url, query = tiny_models["llama"], "http://127.0.0.1:9", ("--width", 1, "--depth", 1)
    for args in (
        [llama, "--url", url, *query],
        ["--url", url, *query, "--memory", "1GiB"],
        ["--url", url, "--table", "--kv-bits", 4],
    ):
        assert "offline only" in one_line_error(invoke("plan", *args)), args
    assert "--kv-bits" in one_line_error(invoke("estimate", "--url", url, "--prompt", "hi", "--kv-bits", 3))
    assert "--model names" in one_line_error(invoke("plan", llama, *query, "--model", "other"))
    assert "--table shows every width" in one_line_error(invoke("plan", llama, "--table", "--width", 4))


def test_plan_url_matches_offline(small_memory_model: tuple[Path, int], monkeypatch: pytest.MonkeyPatch) -> None:
    """`--url` answers with the server's table: the arithmetic `gmlx plan` runs offline, plus what
    the server's warm-up measured of a prefill chunk (the tiny model's blocks hold more than derived)."""
    path, memory = small_memory_model
    monkeypatch.setenv("GMLX_GOVERNOR", "0")  # the server runs without a governor: plan offline as it does
    queries = {(1, 512): True, (4, 1024): False, (1, 1000): True, (1, 5000): False}  # 4 streams bring 4 chunks
    with LiveServer(path, memory=memory, governor=False) as server:
        growth = server.model.prefill_growth()
        expected = offline_table(path, memory, growth=growth)
        for (width, depth), ok in queries.items():
            r = invoke("plan", "--url", server.url, "--width", width, "--depth", depth, "--json")
            assert r.exit_code == (0 if ok else 1), r.output
            out = json.loads(r.stdout)
            assert {k: out["plan"][k] for k in SAME_AS_SERVER} == {
                "ok": ok,
                "max_context_at_width": expected.max_context_at_width(width),
                "max_width_at_depth": expected.max_width_at_depth(depth),
            }
            assert out["plan"]["model"] == "cap"
            assert out["assumptions"] == {"source": "server", "url": server.url}
        r = invoke("plan", "--url", server.url, "--width", 1, "--depth", 512)
        assert r.exit_code == 0 and f"figures from the server at {server.url}" in r.stdout
        held = server.model.table().to_json()
        served = invoke_json("plan", "--url", server.url, "--table")
        named = invoke_json("plan", "--url", server.url, "--table", "--model", "cap")
        unknown = invoke("plan", "--url", server.url, "--table", "--model", "nope")
        shown = invoke("plan", "--url", server.url, "--table")
    assert served == named == {"table": held, "assumptions": {"source": "server", "url": server.url}}
    assert "'nope' is not loaded" in one_line_error(unknown)
    assert held == expected.to_json()
    # Offline, the same budget without the measurement: more room than the server found.
    built = invoke_json("plan", path, "--table", "--memory", memory, "--weights", "float", "--decode-batch", 4)
    assert built["table"] == offline_table(path, memory).to_json()
    assert growth is not None and growth.unplanned > 0 and built["table"]["widths"]["1"] > held["widths"]["1"]
    assert shown.exit_code == 0, shown.output
    assert held["headline"] in shown.stdout and f"figures from the server at {server.url}" in shown.stdout
    for width, context in held["widths"].items():
        assert any(line.split() == [width, str(context)] for line in shown.stdout.splitlines()), (width, context)


def test_estimate_offline_matches_server(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    body = {
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}],
        "max_tokens": 100,
    }
    (tmp_path / "request.json").write_text(json.dumps(body))
    memory = 4 * 2**30
    out = invoke_json(
        "estimate", tiny_models["llama"], "--body", tmp_path / "request.json", "--memory", memory, "--weights", "float"
    )
    est = out["estimate"]
    assert est["resident"] is False and est["est_ttft_s"] is None and est["fits_now"] == est["fits_drained"] is True
    assert out["assumptions"]["prefill_tok_s"]["value"] is None
    completion = {"prompt": "hello world", "max_tokens": 5}  # a completions body, as the route reads it
    (tmp_path / "completion.json").write_text(json.dumps(completion))
    offline_completion = invoke_json("estimate", tiny_models["llama"], "--body", tmp_path / "completion.json")
    with LiveServer(tiny_models["llama"], memory=memory, governor=False) as server, server.client() as c:
        served = c.post("/v1/estimate", json=body).json()
        assert (
            offline_completion["estimate"]["prompt_tokens"]
            == c.post("/v1/estimate", json=completion).json()["prompt_tokens"]
        )
        by_url = invoke_json("estimate", "--url", server.url, "--body", tmp_path / "request.json")
        table = server.model.table()
    for key in ("prompt_tokens", "context_ok", "context_limit", "fits_drained", "model"):
        assert est[key] == served[key], key
    # The server's need adds what its warm-up measured a chunk to hold beyond the derivation.
    measured = table.budget.prefill_bytes - offline_table(tiny_models["llama"], memory).budget.prefill_bytes
    assert measured > 0 and served["need_bytes"] == est["need_bytes"] + measured
    assert by_url["estimate"]["prompt_tokens"] == served["prompt_tokens"] and by_url["estimate"]["resident"] is True
    assert by_url["assumptions"] == {"source": "server", "url": server.url}


def test_estimate_prompt_and_exit_codes(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    llama = tiny_models["llama"]
    r = invoke("estimate", llama, "--prompt", "hello world", "--max-tokens", 10)
    assert r.exit_code == 0, r.output
    assert "prompt_tokens" in r.stdout and "prefill_tok_s" in r.stdout
    long = invoke_json("estimate", llama, "--prompt", "word " * 400, code=1)["estimate"]
    assert long["context_ok"] is False and long["context_limit"] == 256
    assert (
        invoke_json("estimate", llama, "--prompt", "hi", "--memory", "512MiB", code=1)["estimate"]["fits_drained"]
        is False
    )
    assert "exactly one of" in one_line_error(invoke("estimate", llama))
    for n in (1, 3, 9):  # the server's decode batch is 8
        (tmp_path / f"n{n}.json").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}], "n": n}))
    one, three = (invoke_json("estimate", llama, "--body", tmp_path / f"n{n}.json")["estimate"] for n in (1, 3))
    row = one["need_bytes"] - invoke_json("plan", llama, "--table")["table"]["budget"]["prefill_bytes"]
    assert row > 0 and three["need_bytes"] == one["need_bytes"] + 2 * row  # each choice its own row
    assert "'n' must be at most 8" in one_line_error(invoke("estimate", llama, "--body", tmp_path / "n9.json"))
    (tmp_path / "bad.json").write_text('{"messages": "x"}')
    assert "'messages'" in one_line_error(invoke("estimate", llama, "--body", tmp_path / "bad.json"))
    (tmp_path / "broken.json").write_text("{")
    assert "broken.json" in one_line_error(invoke("estimate", llama, "--body", tmp_path / "broken.json"))
    (tmp_path / "utf16.json").write_text('{"prompt": "hi"}', encoding="utf-16")  # was a traceback, exit 1
    assert "utf16.json" in one_line_error(invoke("estimate", llama, "--body", tmp_path / "utf16.json"))


def test_url_api_key(tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    with LiveServer(tiny_models["llama"], api_key="sesame") as server:
        assert "401" in one_line_error(invoke("plan", "--url", server.url, "--width", 1, "--depth", 1))
        assert invoke("plan", "--url", server.url, "--width", 1, "--depth", 1, "--api-key", "sesame").exit_code == 0
        monkeypatch.setenv("GMLX_API_KEY", "sesame")
        assert invoke("estimate", "--url", server.url, "--prompt", "hi").exit_code == 0
