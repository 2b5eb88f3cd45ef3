"""POST /v1/embeddings: one vector per input, from the served model, on its engine thread.

The input is a string, a list of strings, a list of token ids, or a list of such lists (OpenAI's
shapes); each is tokenized as a completions prompt is (with the vocabulary's BOS), must be non-empty
and fit the context window. The vectors are pooled and normalised as llama.cpp's server does
(engine/embeddings.py), and come back as floats or, with `encoding_format: base64`, as the base64 of
little-endian float32 (what the openai client asks for by default). A request takes one admission
slot while the engine computes, so embeddings queue with generation rather than beside it. The
metrics list it as a request row of kind `embedding` from its arrival to its answer, and count it
in their `embeddings` section. The engine runs one input per iteration, between decode steps, and
drops the rest when the client leaves.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
import uuid
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gmlx.engine.embeddings import pooling_for
from gmlx.engine.engine import Engine
from gmlx.server.admission import Slot
from gmlx.server.errors import APIError, bad_request
from gmlx.server.fields import check_embedding_fields
from gmlx.server.http import ClientGone, read_json, unless_disconnected
from gmlx.server.openai_api import is_integer
from gmlx.server.state import EmbeddingRow, ModelState, ServerState

log = logging.getLogger("gmlx.server")
MAX_INPUTS = 2048  # OpenAI's bound on one request's inputs
_SHAPES = "a string, a list of strings, a list of token ids, or a list of those"


def parse_inputs(body: Any) -> list[str | list[int]]:
    """The body's inputs, checked (and its other fields); also what /v1/estimate reads."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    check_embedding_fields(body)
    value = body.get("input")
    if isinstance(value, str) or (isinstance(value, list) and value and all(is_integer(t) for t in value)):
        value = [value]  # one input
    if not isinstance(value, list):
        raise bad_request(f"'input' must be {_SHAPES}, not {json.dumps(value)[:40]}", "input")
    if not value:
        raise bad_request(f"'input' must be {_SHAPES}, not empty", "input")
    if len(value) > MAX_INPUTS:
        raise bad_request(f"'input' holds {len(value)} inputs; at most {MAX_INPUTS}", "input")
    out: list[str | list[int]] = []
    for item in value:
        if isinstance(item, list) and item and all(is_integer(t) for t in item):
            out.append([int(t) for t in item])
        elif isinstance(item, str) and item:
            out.append(item)
        else:
            raise bad_request(f"'input' must be {_SHAPES}; none of them empty", "input")
    fmt = body.get("encoding_format")
    if fmt not in (None, "float", "base64"):
        raise bad_request(f"'encoding_format' must be float or base64, not {fmt!r}", "encoding_format")
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise bad_request("'model' must be a string", "model")
    return out


def input_ids(tokenizer: Any, vocab_size: int, inputs: list[str | list[int]]) -> list[list[int]]:
    """Each input's ids, checked against the vocabulary; the window is the caller's to judge."""
    out = []
    for i, item in enumerate(inputs):
        ids = tokenizer.encode(item) if isinstance(item, str) else item
        if not all(0 <= t < vocab_size for t in ids):
            raise bad_request(f"input {i}: token ids must be in [0, {vocab_size})", "input")
        if not ids:
            raise bad_request(f"input {i} is empty", "input")
        out.append(ids)
    return out


def _tokenize(m: ModelState, inputs: list[str | list[int]]) -> list[list[int]]:
    """Each input's ids, each within the context window (off the loop)."""
    loaded = m.engine.loaded if m.engine is not None else None
    assert loaded is not None
    with m.tokenizer_lock:  # the tokenizer is shared with the generation routes
        out = input_ids(loaded.tokenizer, loaded.geometry.vocab_size, inputs)
    for i, ids in enumerate(out):
        if len(ids) > loaded.context_length:
            raise bad_request(
                f"input {i} has {len(ids)} tokens; the context window holds {loaded.context_length}",
                "input",
                code="context_length_exceeded",
            )
    return out


def _encoded(vector: list[float], fmt: str | None) -> list[float] | str:
    if fmt != "base64":
        return vector
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")


async def _run(engine: Engine, ids: list[list[int]], pooling: str) -> list[list[float]]:
    loop = asyncio.get_running_loop()
    answer: asyncio.Future[list[list[float]]] = loop.create_future()

    def settle(vectors: list[list[float]] | None, error: str | None) -> None:  # on the loop
        if answer.done():  # its client left meanwhile
            return
        if vectors is None:
            answer.set_exception(APIError(500, error or "embedding failed", "embedding_failed"))
        else:
            answer.set_result(vectors)

    job = engine.embed(ids, pooling, lambda v, e: loop.call_soon_threadsafe(settle, v, e))
    try:
        return await answer
    except asyncio.CancelledError:  # its client left: the inputs not yet run are dropped
        job.cancel()
        raise


async def embeddings(request: Request) -> Response:
    state: ServerState = request.app.state.gmlx
    arrived = time.monotonic()
    body = await read_json(request, state)
    inputs = parse_inputs(body)
    m = state.find(body.get("model"))
    row = EmbeddingRow("embd-" + uuid.uuid4().hex[:24], len(inputs), arrived)
    m.embeddings[row.id] = row  # listed from here to its answer (metrics' requests rows)
    try:
        return await _answer(request, state, m, row, inputs, body.get("encoding_format"))
    finally:
        del m.embeddings[row.id]


async def _answer(
    request: Request, state: ServerState, m: ModelState, row: EmbeddingRow, inputs: list, fmt: str | None
) -> Response:
    assert state.residency is not None
    async with state.residency.pinned(m):  # resident until its slot keeps it so
        # Checked before the queue when the model is there; while it loads, once it holds a slot.
        ids = row.tokenized(await asyncio.to_thread(_tokenize, m, inputs)) if m.ready else None
        try:
            await unless_disconnected(request, m.gate.acquire(1), abandon=lambda _: m.gate.release(1))
        except ClientGone:
            return Response(status_code=499)
    slot = Slot(m.gate)
    try:
        ids = ids or row.tokenized(await asyncio.to_thread(_tokenize, m, inputs))
        engine = m.engine
        assert engine is not None and engine.loaded is not None  # its slot keeps it resident
        pooling = pooling_for(engine.loaded.header)
        row.started_at = time.monotonic()
        try:
            vectors = await unless_disconnected(request, _run(engine, ids, pooling))
        except APIError:
            m.embedding_stats.failed += 1
            raise
    except ClientGone:
        return Response(status_code=499)
    finally:
        slot.release()
    tokens = row.tokens or 0
    m.embedding_stats.requests += 1
    m.embedding_stats.input_tokens += tokens
    log.info("%s embeddings inputs=%d tokens=%d pooling=%s model=%s", row.id, len(ids), tokens, pooling, m.model_id)
    return JSONResponse(
        {
            "object": "list",
            "model": m.model_id,
            "data": [{"object": "embedding", "index": i, "embedding": _encoded(v, fmt)} for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
    )
