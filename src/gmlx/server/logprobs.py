"""The engine's token log-probabilities in OpenAI's two shapes: chat's `content` entries
(`token`, `logprob`, `bytes`, `top_logprobs`) and the completions API's parallel lists."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gmlx.engine.logprobs import TokenLogprob

# JSON has no -inf (a token a grammar or a -100 bias ruled out): OpenAI's clients read this floor.
FLOOR = -9999.0


def _value(logprob: float) -> float:
    return logprob if logprob >= FLOOR else FLOOR  # NaN too: a broken row must not break the JSON


def _entry(token: int, logprob: float, vocab: Sequence[bytes]) -> dict[str, Any]:
    raw = vocab[token]
    return {"token": raw.decode("utf-8", errors="replace"), "logprob": _value(logprob), "bytes": list(raw)}


def chat_logprobs(scored: list[TokenLogprob], vocab: Sequence[bytes]) -> dict[str, Any]:
    content = [
        {**_entry(s.token, s.logprob, vocab), "top_logprobs": [_entry(t, v, vocab) for t, v in s.top]} for s in scored
    ]
    return {"content": content, "refusal": None}


def completion_logprobs(scored: list[TokenLogprob], vocab: Sequence[bytes], offset: int = 0) -> dict[str, Any]:
    """`offset`: where this text starts in the whole completion (a stream's later chunks)."""
    tokens, offsets, tops = [], [], []
    for s in scored:
        offsets.append(offset)
        tokens.append(vocab[s.token].decode("utf-8", errors="replace"))
        offset += len(tokens[-1])
        top: dict[str, float] = {}
        for t, v in s.top:  # best first: two tokens of the same text show the likelier
            top.setdefault(vocab[t].decode("utf-8", errors="replace"), _value(v))
        tops.append(top)
    return {
        "tokens": tokens,
        "token_logprobs": [_value(s.logprob) for s in scored],
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def shape(chat: bool, scored: list[TokenLogprob] | None, vocab: Sequence[bytes], offset: int = 0) -> dict | None:
    if scored is None:
        return None
    return chat_logprobs(scored, vocab) if chat else completion_logprobs(scored, vocab, offset)
