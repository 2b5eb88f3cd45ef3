"""Generated text continues the prompt: prompt + completion reads as the whole token sequence
decoded, the first token's leading space included (" Paris" after "... France is"), in the
engine's routes and in `gmlx run`, for SentencePiece and byte-level vocabularies."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import LiveServer, invoke
from tiny_models import write_model

from gmlx.gguf.detokenizer import continuation_detokenizer
from gmlx.gguf.header import read_header
from gmlx.gguf.tokenizer import load_tokenizer

PROMPT = "the capital of France is"
# A SentencePiece vocabulary with a space prefix (Llama 2's), one without (Gemma's), a byte-level one.
CASES = {"spm-prefix": ("llama", True, "▁Paris"), "spm": ("llama", False, "▁Paris"), "bpe": ("qwen2", False, "Ġworld")}


@pytest.fixture(scope="module", params=list(CASES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    arch, space_prefix, word = CASES[request.param]
    path = write_model(tmp_path_factory.mktemp("cont") / f"{request.param}.gguf", arch, space_prefix=space_prefix)
    return path, word


def _whole(tokenizer, prompt_ids: list[int], generated: list[int]) -> str:
    """What decoding the completion with its prompt adds to the prompt's own text."""
    prompt_text = tokenizer.decode(prompt_ids, skip_special_tokens=True)
    whole = tokenizer.decode(prompt_ids + generated, skip_special_tokens=True)
    assert whole.startswith(prompt_text)
    return whole[len(prompt_text) :]


def _stream(tokenizer, prompt_ids: list[int], generated: list[int]) -> str:
    detok = continuation_detokenizer(tokenizer, prompt_ids)
    parts = []
    for token in generated:
        detok.add_token(token)
        parts.append(detok.last_segment)
    detok.finalize()
    return "".join(parts) + detok.last_segment


def test_streamed_text_continues_the_prompt(case: tuple[Path, str], tmp_path: Path) -> None:
    path, word = case
    tok = load_tokenizer(read_header(path), cache_dir=tmp_path)
    word_id = tok.convert_tokens_to_ids(word)
    prompts = [
        tok.encode(PROMPT),
        tok.encode("hello"),
        tok.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True),
    ]
    for prompt_ids in prompts:
        for generated in ([word_id], [word_id, word_id], tok.encode(" hello world", add_special_tokens=False)):
            assert _stream(tok, prompt_ids, generated) == _whole(tok, prompt_ids, generated)
    assert _stream(tok, tok.encode(PROMPT), [word_id]) == " " + word[1:]
    # Specials alone are no text: a completion of nothing starts the document, as decoding does.
    bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
    if bos:
        assert _stream(tok, bos, [word_id]) == _whole(tok, bos, [word_id])


def test_every_route_keeps_the_leading_space(case: tuple[Path, str]) -> None:
    path, word = case
    with LiveServer(path) as server, server.client() as c:
        tok = server.engine.loaded.tokenizer
        word_id = tok.convert_tokens_to_ids(word)
        forced = {"max_tokens": 2, "temperature": 0, "logit_bias": {str(word_id): 100}}
        prompt_ids = tok.encode(PROMPT)
        expected = _whole(tok, prompt_ids, [word_id, word_id])
        assert expected == 2 * (" " + word[1:])
        r = c.post("/v1/completions", json={"prompt": PROMPT, **forced})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == expected
        with c.stream("POST", "/v1/completions", json={"prompt": PROMPT, "stream": True, **forced}) as s:
            streamed = "".join(_texts(s.iter_lines()))
        assert streamed == expected
        # A chat answer continues the template's text the same way: what the model's tokens say.
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hello"}], **forced})
        assert r.json()["choices"][0]["message"]["content"] == expected


def _texts(lines) -> list[str]:
    out = []
    for line in lines:
        if line.startswith("data: {"):
            out += [ch["text"] for ch in json.loads(line[6:]).get("choices", [])]
    return out


def test_run_keeps_the_leading_space(case: tuple[Path, str], monkeypatch: pytest.MonkeyPatch) -> None:
    import mlx.core as mx
    import mlx_lm

    path, word = case
    real = mlx_lm.stream_generate
    seen: dict = {}

    def forced(model, tokenizer, prompt, **kw):  # every step samples `word`
        word_id = tokenizer.convert_tokens_to_ids(word)
        seen.update(tokenizer=tokenizer, prompt=list(prompt), word_id=word_id)
        kw["sampler"] = lambda logprobs: mx.array([word_id] * logprobs.shape[0])
        return real(model, tokenizer, prompt, **kw)

    monkeypatch.setattr(mlx_lm, "stream_generate", forced)
    r = invoke("run", str(path), "--prompt", PROMPT, "-n", "3", "--weights", "float", "--json")
    assert r.exit_code == 0, r.output
    text = json.loads(r.stdout)["text"]
    assert text == _whole(seen["tokenizer"], seen["prompt"], [seen["word_id"]] * 3) == 3 * (" " + word[1:])
