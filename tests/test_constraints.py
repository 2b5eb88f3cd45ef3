"""Structured outputs: response_format by grammar-constrained decoding (gmlx.engine.grammar)."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import llguidance
import numpy as np
import openai
import pytest
from conftest import LiveServer, needs_kernels
from tiny_models import VOCAB_KIND, write_model
from tiny_vocab import BYTE, CONTROL, USER_DEFINED, byte_alphabet

from gmlx import kernels
from gmlx.engine.grammar import (
    Constraint,
    GrammarError,
    GrammarProcessor,
    additive_mask,
    json_schema_constraint,
    json_schema_grammar,
    vocabulary,
)
from gmlx.models.loader import LoadedModel, load
from gmlx.server.metrics import snapshot

CHAT = "/v1/chat/completions"
# Small enough that a tiny model's random choices close it well within its 256-token window.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "size": {"type": "integer", "minimum": 0, "maximum": 999},
        "kind": {"enum": ["cat", "dog"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "size", "kind", "ok"],
    "additionalProperties": False,
}


def structured(schema: dict = SCHEMA, **kw: object) -> dict:
    return {
        "messages": [{"role": "user", "content": "Describe a pet."}],
        "max_tokens": 200,
        "response_format": {"type": "json_schema", "json_schema": {"name": "pet", "schema": schema, "strict": True}},
        **kw,
    }


def _expected_bytes(header) -> list[bytes | None]:
    """Each token's bytes as llama.cpp would emit them, from the GGUF alone (None: a special token)."""
    tokens, types = list(header.get("tokenizer.ggml.tokens")), [int(t) for t in header.get("tokenizer.ggml.token_type")]
    if header.get("tokenizer.ggml.model") == "gpt2":
        unbyte = {c: b for b, c in enumerate(byte_alphabet())}
        return [None if ty == CONTROL else bytes(unbyte[c] for c in t) for t, ty in zip(tokens, types)]
    out: list[bytes | None] = []
    for t, ty in zip(tokens, types):
        if ty == BYTE:
            out.append(bytes([int(t[3:5], 16)]))
        elif ty == USER_DEFINED:
            out.append(t.encode())
        elif ty == CONTROL:
            out.append(None)
        else:
            out.append(t.replace("\u2581", " ").encode())
    return out


@pytest.fixture(scope="module")
def models(tiny_models: dict[str, Path]) -> dict[str, LoadedModel]:
    return {arch: load(path, weights="float") for arch, path in tiny_models.items()}


def _wrong_bytes(m: LoadedModel) -> list[int]:
    vocab = vocabulary(m).tokenizer
    expected = _expected_bytes(m.header)
    assert len(expected) == vocab.vocab_size == m.geometry.vocab_size
    return [
        i
        for i, want in enumerate(expected)
        if want != b"\xff"  # llguidance's special-token marker
        and (
            not vocab.is_special_token(i)
            if want is None
            else vocab.decode_bytes([i]) != want or vocab.is_special_token(i)
        )
    ]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # a SentencePiece and a byte-level vocabulary
def test_the_grammar_sees_each_tokens_bytes(models: dict[str, LoadedModel], arch: str) -> None:
    m = models[arch]
    assert VOCAB_KIND[arch] == m.header.get("tokenizer.ggml.model")
    assert _wrong_bytes(m) == []
    # llguidance's own reading of the tokenizer.json gmlx builds agrees
    own = llguidance.LLTokenizer(m.tokenizer._tokenizer.backend_tokenizer.to_str())
    ours = vocabulary(m).tokenizer
    assert [
        i
        for i in range(ours.vocab_size)
        if own.decode_bytes([i]) != ours.decode_bytes([i]) or own.is_special_token(i) != ours.is_special_token(i)
    ] == []


@pytest.mark.slow
def test_the_grammar_sees_the_default_models_bytes(default_model: Path) -> None:
    m = load(default_model, "auto")
    assert m.geometry.vocab_size == 262144 and _wrong_bytes(m) == []


def test_additive_mask() -> None:
    bits = np.zeros((1, 2), dtype=np.int32)
    bits[0, 0] = 0b101  # tokens 0 and 2
    bits[0, 1] = np.int32(-(2**31))  # token 63
    mask = additive_mask(bits, 64)
    assert mask.dtype == np.float32 and mask.shape == (64,)
    assert [i for i in range(64) if mask[i] == 0] == [0, 2, 63]
    assert np.isneginf(np.delete(mask, [0, 2, 63])).all()


def test_schema_errors_name_the_problem(models: dict[str, LoadedModel]) -> None:
    with pytest.raises(GrammarError, match="Unimplemented keys"):
        json_schema_grammar({"not": {"type": "string"}})
    with pytest.raises(GrammarError, match="minimum"):
        json_schema_grammar({"type": "integer", "minimum": 5, "maximum": 1})
    with pytest.raises(GrammarError, match="JSON object"):
        json_schema_grammar(["type", "string"])
    with pytest.raises(GrammarError, match="Invalid type"):
        json_schema_constraint({"type": "nope"}, models["llama"])
    first = json_schema_constraint(SCHEMA, models["llama"])
    assert isinstance(first, Constraint)
    assert json_schema_constraint(dict(SCHEMA), models["llama"]) is first  # cached


@needs_kernels
def test_the_kernels_mask_is_the_additive_mask() -> None:
    import mlx.core as mx

    rng = np.random.default_rng(8)
    for rows, width in ((1, 64), (3, 1000), (2, 262_144)):
        x = rng.standard_normal((rows, width)).astype(np.float32)
        bits = rng.integers(-(2**31), 2**31, size=(rows, (width + 31) // 32 + 1), dtype=np.int64).astype(np.int32)
        bits[0, 1] = -1  # a whole word allowed
        bits[-1, 0] = 0  # a whole word forbidden
        got = np.array(kernels.extension().mask_tokens(mx.array(x), mx.array(bits)))
        want = np.stack([x[r] + additive_mask(bits[r : r + 1], width) for r in range(rows)])
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError):
        kernels.extension().mask_tokens(mx.zeros((1, 65)), mx.zeros((1, 2), dtype=mx.int32))


@pytest.mark.parametrize("fused", [True, False] if kernels.available() else [False])
def test_a_row_masks_what_its_grammar_forbids(
    models: dict[str, LoadedModel], fused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The processor consumes only what follows the prompt, and allows EOS once the grammar is done."""
    import mlx.core as mx

    if not fused:
        monkeypatch.setattr(kernels, "available", lambda: False)

    m = models["qwen2"]
    tokenizer, width = m.tokenizer, m.geometry.vocab_size
    row = GrammarProcessor(json_schema_constraint({"enum": ["He"]}, m), start=3)
    prompt = mx.array([5, 6, 7], dtype=mx.int32)
    logits = mx.zeros((1, width))
    allowed = np.isfinite(np.array(row(prompt, logits)[0]))
    quote = tokenizer.encode('"', add_special_tokens=False)
    assert allowed[quote].all() and allowed.sum() < width
    text = tokenizer.encode('"He"', add_special_tokens=False)
    after = np.isfinite(np.array(row(mx.array([5, 6, 7, *text], dtype=mx.int32), logits)[0]))
    assert sorted(np.flatnonzero(after)) == sorted(tokenizer.eos_token_ids)


def test_json_schema_validates_in_a_mixed_batch(tiny_models: dict[str, Path]) -> None:
    """20 seeded sampled requests at temperature 1, decoding beside unconstrained ones."""
    with LiveServer(tiny_models["llama"], decode_batch=8, queue_size=32) as server, server.client() as c:
        free = {"messages": [{"role": "user", "content": "Say anything."}], "max_tokens": 40, "temperature": 1.0}
        bodies = [structured(temperature=1.0, seed=s) for s in range(20)] + [{**free, "seed": s} for s in range(6)]
        with ThreadPoolExecutor(len(bodies)) as pool:
            replies = list(pool.map(lambda b: c.post(CHAT, json=b), bodies))
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies if r.status_code != 200]
    outputs = [r.json()["choices"][0] for r in replies[:20]]
    for choice in outputs:
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
        assert choice["finish_reason"] == "stop"  # the grammar closed, then EOS
    assert len({o["message"]["content"] for o in outputs}) > 10  # sampled, not one forced answer
    assert any(r.json()["choices"][0]["message"]["content"][:1] != "{" for r in replies[20:])  # free rows stay free


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_json_schema_on_other_vocabularies(tiny_models: dict[str, Path], arch: str) -> None:
    with LiveServer(tiny_models[arch]) as server, server.client() as c:
        for seed in range(3):
            r = c.post(CHAT, json=structured(temperature=1.0, seed=seed))
            assert r.status_code == 200, r.text
            jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["content"]), SCHEMA)


def test_json_object_parses(live_server: LiveServer) -> None:
    body = {
        "messages": [{"role": "user", "content": "JSON please"}],
        "max_tokens": 200,
        "temperature": 1.0,
        "response_format": {"type": "json_object"},
    }
    with live_server.client() as c:
        for seed in range(3):
            r = c.post(CHAT, json={**body, "seed": seed})
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            if choice["finish_reason"] == "stop":  # an open object may run to max_tokens
                assert isinstance(json.loads(choice["message"]["content"]), dict)
            else:
                assert choice["message"]["content"].startswith("{")
        r = c.post(CHAT, json={**body, "response_format": {"type": "text"}, "temperature": 0})
        assert r.status_code == 200


@pytest.mark.parametrize(
    "fmt",
    [
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {"type": "string"}}}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(("}}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}}},
        {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": "object"}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": "yes"}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": True}},
        {"type": "json_schema", "json_schema": {"name": "x", "description": 3}},
        {"type": "json_schema"},
        {"type": "text", "json_schema": 5},  # the schema checks json_schema whatever the type
        {"type": "json_object", "json_schema": {"name": 1}},
        {"type": "yaml"},
        {},
        "json",
    ],
)
def test_bad_response_format_is_400(live_server: LiveServer, fmt: object) -> None:
    body = {"messages": [{"role": "user", "content": "x"}], "response_format": fmt}
    with live_server.client() as c:
        for route in (CHAT, "/v1/estimate"):  # an estimate refuses what the request itself would
            r = c.post(route, json=body)
            assert r.status_code == 400, (route, r.text)
            error = r.json()["error"]
            assert error["param"] == "response_format" and error["code"] == "invalid_request"
        assert c.post(CHAT, json=structured(temperature=0)).status_code == 200  # the engine keeps serving
    assert live_server.engine.alive


def test_output_a_grammar_holds_ends_where_the_grammar_does(tmp_path: Path) -> None:
    """A stop string inside a JSON string value does not cut the JSON (it would be invalid under
    finish_reason stop), nor a forced call (its JSON would become the reply's text); and JSON that
    closes on the max_tokens-th token is complete, not cut."""
    tool = {"type": "function", "function": {"name": "pet", "parameters": SCHEMA}}
    roomy = write_model(tmp_path / "roomy.gguf", "llama", context=4096)  # the tool prompt needs it
    with LiveServer(roomy) as server, server.client() as c:
        whole = c.post(CHAT, json=structured(temperature=0)).json()
        content, tokens = whole["choices"][0]["message"]["content"], whole["usage"]["completion_tokens"]
        jsonschema.validate(json.loads(content), SCHEMA)
        inside = content[content.index(":") :][:3]  # e.g. ': "', written before the JSON closes
        for stop in ([inside], ["}"], [inside, "}"]):
            choice = c.post(CHAT, json=structured(temperature=0, stop=stop)).json()["choices"][0]
            assert (choice["message"]["content"], choice["finish_reason"]) == (content, "stop"), stop
        exact = c.post(CHAT, json=structured(temperature=0, max_tokens=tokens)).json()["choices"][0]
        assert (exact["message"]["content"], exact["finish_reason"]) == (content, "stop")
        cut = c.post(CHAT, json=structured(temperature=0, max_tokens=tokens - 1)).json()["choices"][0]
        assert cut["finish_reason"] == "length" and content.startswith(cut["message"]["content"])
        ask = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 200, "temperature": 0, "tools": [tool]}
        one = {**ask, "tool_choice": "required", "parallel_tool_calls": False, "stop": ["}", '"']}
        called = c.post(CHAT, json=one).json()["choices"][0]
        assert called["finish_reason"] == "tool_calls" and called["message"]["content"] is None
        [call] = called["message"]["tool_calls"]
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMA)
        # Calls until max_tokens (a tiny random model does not close the array): the whole ones, no text.
        many = c.post(CHAT, json={**ask, "tool_choice": "required"}).json()["choices"][0]
        assert many["finish_reason"] == "length" and many["message"]["content"] is None
        assert many["message"]["tool_calls"]
        for call in many["message"]["tool_calls"]:
            jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMA)
        free = c.post(CHAT, json={**ask, "stop": ["a"], "max_tokens": 40}).json()["choices"][0]
        assert "a" not in (free["message"]["content"] or "")  # free text is cut by stop as before


def test_bad_schema_message_names_the_problem(live_server: LiveServer) -> None:
    with live_server.client() as c:
        r = c.post(CHAT, json=structured({"type": "object", "properties": {"a": {"if": {"type": "string"}}}}))
    assert r.status_code == 400 and "if" in r.json()["error"]["message"]


def test_constrained_rows_never_speculate(tiny_models: dict[str, Path]) -> None:
    """With a drafter, a constrained request decodes in the batch, and its row says why."""
    path = tiny_models["llama"]
    with LiveServer(path, draft=str(path)) as server, server.client() as c:
        assert server.engine.draft is not None
        seen: list[str | None] = []
        done = threading.Event()

        def watch() -> None:  # the request's live row, as /v1/metrics shows it
            while not done.is_set() and not seen:
                rows = snapshot(server.state)["server"]["requests"]
                seen.extend(row["speculative"]["off"] for row in rows if row["speculative"] is not None)

        watcher = threading.Thread(target=watch)
        watcher.start()
        r = c.post(CHAT, json=structured(temperature=0))
        done.set()
        watcher.join()
        assert r.status_code == 200
        assert seen and "grammar" in seen[0]
        jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["content"]), SCHEMA)
        assert server.engine.stats.speculative.rounds == 0
        free = c.post(CHAT, json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 24, "temperature": 0})
        assert free.status_code == 200 and server.engine.stats.speculative.rounds > 0


@pytest.mark.slow
def test_default_model_json_schema_with_the_openai_client(default_model: Path) -> None:
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 40},
            "population": {"type": "integer", "minimum": 0, "maximum": 10**9},
        },
        "required": ["city", "population"],
        "additionalProperties": False,
    }
    with LiveServer(default_model, weights="auto") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
        r = client.chat.completions.create(
            model=server.model_id,
            max_tokens=64,
            temperature=0,
            messages=[{"role": "user", "content": "Name the capital of France and its population, as JSON."}],
            response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}},
        )
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
