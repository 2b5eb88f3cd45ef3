"""Embeddings of a causal model, pooled as llama.cpp's server pools them; run on the engine thread.

llama.cpp takes the hidden state after the final norm (`result_norm`, before the output head) and
pools it by the GGUF's `<arch>.pooling_type`: 1 mean, 2 cls (the first token), 3 last. A causal
LM's file carries no such key, and llama.cpp then pools `none`, which its `/v1/embeddings`
refuses until the server is started with `--pooling`; its own test suite starts causal models
with `--pooling last`. gmlx does the same without the flag: the key when the file has one, else
the last token, the only one a causal model has let see the whole input. Each vector is then
L2-normalised (llama.cpp's default `embd_normalize` 2).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx

from gmlx.gguf.header import GGUFHeader
from gmlx.models.loader import LoadedModel
from gmlx.upstream import layer_by_layer

POOLINGS = ("mean", "cls", "last")
_GGUF_POOLING = {1: "mean", 2: "cls", 3: "last"}  # llama_pooling_type; 0 is none, 4 rank (a reranker's)
DEFAULT_POOLING = "last"


@dataclass(eq=False)
class EmbedJob:
    """One embeddings request on the engine thread. Its inputs run one per engine iteration, so the
    batch's decode steps go on between them; `cancel()` (any thread: its client left) drops the
    inputs not yet run, and `done` is then never called."""

    inputs: list[list[int]]
    pooling: str
    done: Callable[[list[list[float]] | None, str | None], None]  # (vectors, None) or (None, why it failed)
    vectors: list[list[float]] = field(default_factory=list)
    _cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    @property
    def next_input(self) -> list[int] | None:
        return self.inputs[len(self.vectors)] if len(self.vectors) < len(self.inputs) else None


def pooling_for(header: GGUFHeader) -> str:
    """The model's pooling: its GGUF key when that names mean, cls or last, else the last token."""
    return _GGUF_POOLING.get(header.arch_key("pooling_type"), DEFAULT_POOLING)


def embed(
    loaded: LoadedModel, make_cache: Callable[[object], list], ids: list[int], pooling: str, step: int
) -> list[float]:
    """One input's vector: the decoder's normed hidden states over `ids`, run in `step`-token chunks
    through a cache as a prefill is (so the working set is a prefill chunk's), pooled, normalised."""
    decoder = loaded.model.model  # mlx_lm's stack up to the final norm; the output head is left out
    cache = make_cache(loaded.model)
    total = first = last = None
    for start in range(0, len(ids), step):
        with layer_by_layer(loaded.model):
            hidden = decoder(mx.array([ids[start : start + step]]), cache=cache)[0].astype(mx.float32)
        if pooling == "mean":
            total = hidden.sum(axis=0) if total is None else total + hidden.sum(axis=0)
            mx.eval(total)
        elif pooling == "cls":
            first = hidden[0]
            break  # a causal model's first token has seen nothing after it
        else:
            last = hidden[-1]
            mx.eval(last)
    vector = total / len(ids) if pooling == "mean" else first if pooling == "cls" else last
    assert vector is not None
    norm = mx.sqrt((vector * vector).sum())
    vector = mx.where(norm > 0, vector / norm, mx.zeros_like(vector))  # llama.cpp: a zero vector stays zero
    return vector.tolist()
