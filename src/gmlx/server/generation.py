"""The generation path: a chat or completions request, from its body to its answer.

A request asks for `n` choices. Each is its own engine row, with its own slot, tool-call parser,
logprobs and finish; all deliver into one queue, and they end together: one failing (or cancelled
at shutdown) cancels the others, and a client leaving cancels them all. The prompt is prefilled
once: the first choice keeps a checkpoint just before the prompt's last token, and the others are
submitted once it has prefilled, so the prompt cache hands them the prompt and they prefill only
that last token. Without a prompt cache they are submitted together and each prefills it all.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from gmlx.engine.engine import Chunk, Event, Failed, Finished
from gmlx.engine.engine import Request as EngineRequest
from gmlx.engine.grammar import GrammarError, compile_grammar
from gmlx.engine.logprobs import TokenLogprob
from gmlx.engine.processors import Decoding
from gmlx.engine.sampling import SamplingParams
from gmlx.server import logprobs, openai_api, tools
from gmlx.server.admission import RETRY_AFTER_FULL_S, Slot
from gmlx.server.capacity_routes import estimate_body
from gmlx.server.errors import APIError, bad_request
from gmlx.server.fingerprint import system_fingerprint
from gmlx.server.http import ClientGone, give_up, read_json, relay, unless_disconnected
from gmlx.server.state import ModelState, QueuedRow, ServerState

log = logging.getLogger("gmlx.server")
_PREFILL_POLL_S = 0.005  # how often the later choices look whether the first has prefilled
# A client asking for queue events (docs/api.md) gets an SSE comment this often while its request waits.
QUEUE_EVENTS_HEADER = "x-gmlx-queue-events"
QUEUE_EVENT_EVERY_S = 1.0


async def generate(request: Request, chat: bool) -> Response:
    arrived = time.monotonic()  # a client's TTFT counts from its request, so the server's does
    state: ServerState = request.app.state.gmlx
    body = await read_json(request, state)
    if isinstance(body, dict) and body.get("dry_run") is True:
        return JSONResponse(await estimate_body(state, body, chat))
    p, prepared = openai_api.parse(body, chat), None
    if p.stream and request.headers.get(QUEUE_EVENTS_HEADER, "").lower() in ("1", "true", "yes"):
        m = state.find(p.model)
        # Refusals it can meet now are answered with their status; it streams once it must wait.
        prepared = await _prepare(m, p) if m.ready else None
        if _must_wait(m, p):
            return sse(_queued_stream(request, state, m, p, arrived, prepared))
    gen = await admit(request, state, p, arrived, prepared=prepared)
    if isinstance(gen, Response):
        return gen
    if gen.p.stream:
        return sse(gen.stream())
    answer = await complete(request, gen)
    return answer if isinstance(answer, Response) else JSONResponse(answer)


def _must_wait(m: ModelState, p: openai_api.GenerationParams) -> bool:
    """Its model loading, or every slot taken or promised; and room in the queue (a full one
    refuses it at once, with a 503), and no more choices than slots (a 400)."""
    gate = m.gate
    busy = not m.ready or gate.waiting > 0 or gate.running + p.n > gate.width
    return busy and gate.waiting < gate.cap and p.n <= gate.width


async def _queued_stream(
    request: Request,
    state: ServerState,
    m: ModelState,
    p: openai_api.GenerationParams,
    arrived: float,
    prepared: _Prepared | None,
) -> AsyncIterator[str]:
    """The stream starts at once, and while the request waits it carries an SSE comment (which
    clients skip) every second: its place in its model's queue and the drain time ahead of it,
    `: queued position=2 waiting=3 eta_s=8`. Then it goes on as any stream; a refusal that would
    have been a 503 (queue_timeout, a model that failed to load) is an error event, Retry-After in
    it, as is a 400 only its loading model could find (a prompt longer than its window)."""
    rid = openai_api.new_id(p.chat)
    task = asyncio.ensure_future(admit(request, state, p, arrived, rid, prepared))
    gen: Generation | Response | None = None
    try:
        told = False
        while not task.done():
            if rid in m.queued:
                # Both from the model's queue: a request is in it a moment before the gate counts it.
                ahead = list(m.queued).index(rid) + 1
                eta = m.gate.retry_after(waiting=ahead)
                yield f": queued position={ahead} waiting={len(m.queued)} eta_s={eta}\n\n"
                told = True
            await asyncio.wait({task}, timeout=QUEUE_EVENT_EVERY_S if told else _PREFILL_POLL_S)
        try:
            gen = task.result()
        except APIError as e:
            event = e.body()
            event["error"]["retry_after"] = e.retry_after
            yield _sse_data(event)
            yield "data: [DONE]\n\n"
            return
        if isinstance(gen, Generation):
            async with contextlib.aclosing(gen.stream()) as events:  # closed with this stream: its rows end
                async for data in events:
                    yield data
    finally:
        if gen is None:  # the client left while it waited: its place goes back, and what admission gave since
            give_up(task, _abandon)


def _abandon(admitted: Generation | Response) -> None:
    if isinstance(admitted, Generation):
        admitted.abandon("client_gone")


def sse(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(
        events, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )


@dataclass(frozen=True)
class _Prepared:
    """What a request needs from its model's tokenizer and vocabulary before it runs."""

    prompt_ids: list[int]
    anchor: int
    max_tokens: int
    decoding: Decoding


async def admit(
    request: Request,
    state: ServerState,
    p: openai_api.GenerationParams,
    arrived: float,
    rid: str | None = None,
    prepared: _Prepared | None = None,
) -> Generation | Response:
    """A parsed request, from its checks through its model's admission gate to its started
    Generation (or a 499 for a client gone meanwhile). The chat and completions routes and
    /v1/responses and /v1/messages share it. A request for a model that is not resident starts
    its load and waits in its queue; its prompt is tokenized once the model is there."""
    m = state.find(p.model)
    m.check_choices(p.n)
    assert state.residency is not None
    async with state.residency.pinned(m):  # resident until its slots keep it so
        rid = rid or openai_api.new_id(p.chat)
        admitted = await _queue(request, m, p, rid, arrived, prepared)
    if isinstance(admitted, Response):
        return admitted
    row, prepared = admitted
    assert m.engine is not None and m.engine.loaded is not None  # admitted: its model is loaded
    # The loaded model's vocabulary, not its file's: the file may have gone since it loaded.
    if p.sampling.top_k >= m.engine.loaded.geometry.vocab_size:
        p = replace(p, sampling=replace(p.sampling, top_k=0))  # keeping every token is no top-k (mlx_lm refuses it)

    queued_s = row.queued_s(time.monotonic())
    state.histograms.observe_queue_wait(m.model_id, queued_s)
    gen = Generation(m, p, rid, prepared, row.arrived_at, queued_s)
    gen.start()
    return gen


async def _queue(
    request: Request,
    m: ModelState,
    p: openai_api.GenerationParams,
    rid: str,
    arrived: float,
    prepared: _Prepared | None = None,
) -> tuple[QueuedRow, _Prepared] | Response:
    """A request through its model's gate: tokenized first when the model is there (unless the
    caller did), else once it has loaded (it holds its slots meanwhile, and gives them back on a 400)."""
    if prepared is None and m.ready:
        prepared = await _prepare(m, p)
    row_prompt = len(prepared.prompt_ids) if prepared else "-"  # for the log: unknown until its model loads
    if await request.is_disconnected():  # gone while its prompt was tokenized: no queue place, no rejection
        log.info("%s prompt=%s generated=0 model=%s finish=client_gone (before the queue)", rid, row_prompt, m.model_id)
        return Response(status_code=499)
    row = m.queued[rid] = QueuedRow(  # one row, however many choices
        rid,
        len(prepared.prompt_ids) if prepared else None,
        prepared.max_tokens if prepared else p.max_tokens,
        arrived,
    )
    try:
        await unless_disconnected(request, m.gate.acquire(p.n), abandon=lambda _: m.gate.release(p.n))
    except ClientGone:
        log.info("%s prompt=%s generated=0 model=%s finish=client_gone (while queued)", rid, row_prompt, m.model_id)
        return Response(status_code=499)
    except APIError as e:
        log.info("%s prompt=%s generated=0 model=%s finish=rejected:%s", rid, row_prompt, m.model_id, e.code)
        raise
    finally:
        del m.queued[rid]
    if prepared is None:  # its model loaded while it waited: it holds its slots, and gives them back on a 400
        try:
            prepared = await _prepare(m, p)
        except BaseException:
            m.gate.release(p.n)
            raise
    return row, prepared


async def _prepare(m: ModelState, p: openai_api.GenerationParams) -> _Prepared:
    """The request against its loaded model: its prompt's ids, the tokens it may generate (a 400
    `context_length_exceeded` up front), its logit bias checked and its grammar compiled."""
    loaded = m.engine.loaded  # type: ignore[union-attr]
    assert loaded is not None
    prompt_ids, anchor = await asyncio.to_thread(m.tokenize_with_anchor, p)
    max_tokens = openai_api.completion_budget(p, len(prompt_ids), loaded.context_length, m.settings.max_tokens_default)
    return _Prepared(prompt_ids, anchor, max_tokens, await _decoding(m, p))


async def complete(request: Request, gen: Generation) -> dict | Response:
    """A non-streamed Generation read to its end: the completion, a 499 for a client gone, or the
    failure as an APIError."""
    state = gen.state
    try:
        failure = await unless_disconnected(request, gen.run())
    except ClientGone:
        gen.abandon("client_gone")
        return Response(status_code=499)
    except asyncio.CancelledError:  # its handler was cancelled: nobody reads the answer
        gen.abandon("client_gone")
        raise
    if failure is not None:
        raise _ended_error(state, failure)
    return gen.completion()


def _ended_error(m: ModelState, failure: object) -> APIError:
    """What a request the engine ended answers, as a status or as a stream's error event: a
    `Failed` is a 500, or a 503 to try again later when it was stopped to relieve memory (the
    server's load, not its fault); anything else ended it as the server shut down."""
    if not isinstance(failure, Failed):
        return APIError(503, "the server is shutting down", "shutting_down", retry_after=RETRY_AFTER_FULL_S)
    pressure = failure.code == "memory_pressure"
    return APIError(
        503 if pressure else 500, failure.message, failure.code, retry_after=m.gate.retry_after() if pressure else None
    )


async def _decoding(m: ModelState, p: openai_api.GenerationParams) -> Decoding:
    """The request's Decoding: its logit_bias checked against the vocabulary, its grammar compiled
    for the model (off the loop: a model's first grammar reads its whole vocabulary, a second)."""
    loaded = m.engine.loaded  # type: ignore[union-attr]
    assert loaded is not None
    openai_api.check_logit_bias(p, loaded.geometry.vocab_size)
    if p.grammar is None:
        return p.decoding
    try:
        constraint = await asyncio.to_thread(compile_grammar, p.grammar, loaded)
    except GrammarError as e:
        raise bad_request(f"response_format: the schema cannot be used: {e}", "response_format") from None
    return replace(p.decoding, constraint=constraint)


def _seeded(sampling: SamplingParams, index: int) -> SamplingParams:
    """Choice i samples with seed + i: seeded choices differ from one another, yet repeat."""
    if sampling.seed is None or index == 0:
        return sampling
    return replace(sampling, seed=(sampling.seed + index) % 2**64)


def _failure(e: Finished | Failed) -> bool:
    """An end that ends the whole request: a failure, or a cancel (shutdown)."""
    return isinstance(e, Failed) or e.finish_reason == "cancelled"


def _sse_data(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


@dataclass
class Choice:
    """One choice: its engine row and slot, and what it has produced so far."""

    index: int
    req: EngineRequest
    slot: Slot
    parser: tools.ToolCallParser | None
    parts: list[str] = field(default_factory=list)
    scored: list[TokenLogprob] | None = None  # kept for the non-streamed answer
    offset: int = 0  # where the next streamed chunk's text starts, for the completions API's text_offset
    end: Finished | Failed | None = None
    closed: bool = False  # its one log line is written; nothing more is read from it

    @property
    def text(self) -> str:
        return "".join(self.parts)


class Generation:
    """A request's choices, from submission to their ends. Lives on the event loop."""

    def __init__(
        self,
        state: ModelState,
        p: openai_api.GenerationParams,
        rid: str,
        prepared: _Prepared,
        arrived_at: float | None = None,
        queued_s: float = 0.0,
    ):
        assert state.engine is not None  # its slots keep it resident until its choices end
        self.state, self.engine, self.p, self.rid = state, state.engine, p, rid
        self.fingerprint = system_fingerprint(state.engine)
        self.prompt_for_log = p.messages if p.chat else p.prompt
        self._events: asyncio.Queue[tuple[Choice, Event]] = asyncio.Queue()
        self._rest: asyncio.Task[None] | None = None
        to_loop = relay(asyncio.get_running_loop())  # a step's events for every stream: one loop wake-up
        template = self.engine.loaded.tokenizer.chat_template  # type: ignore[union-attr]
        # Output a grammar holds (response_format, a forced call) ends where the grammar does: a stop
        # string inside one of its JSON strings would cut it invalid, under finish_reason "stop".
        stop = p.stop if prepared.decoding.constraint is None else ()
        self.choices: list[Choice] = []
        for i in range(p.n):
            req = EngineRequest(
                rid if i == 0 else f"{rid}-{i}",
                prepared.prompt_ids,
                prepared.max_tokens,
                _seeded(p.sampling, i),
                stop,
                anchor_tokens=prepared.anchor,
                logprobs=p.logprobs,
                decoding=prepared.decoding,
                keep_prompt=i == 0 and p.n > 1,
                arrived_at=arrived_at,
                queued_s=queued_s,
            )
            choice = Choice(i, req, Slot(state.gate), tools.parser_for(p.tools, template))
            req.emit = lambda e, c=choice: to_loop.call(self._deliver, (c, e))
            self.choices.append(choice)

    def _deliver(self, item: tuple[Choice, Event]) -> None:  # on the loop; a slot frees when its row ends
        self._events.put_nowait(item)
        if isinstance(item[1], (Finished, Failed)):
            item[0].slot.release()

    def start(self) -> None:
        first, *rest = self.choices
        self.engine.submit(first.req)
        if rest and self.engine.prompt_cache is None:  # nowhere to find the prompt: each prefills it
            for c in rest:
                self.engine.submit(c.req)
        elif rest:
            self._rest = asyncio.create_task(self._submit_after_prefill(rest))

    async def _submit_after_prefill(self, rest: list[Choice]) -> None:
        first = self.choices[0].req
        while first.state in ("queued", "prefill"):  # written by the engine thread
            await asyncio.sleep(_PREFILL_POLL_S)
        for c in rest:
            self.engine.submit(c.req)

    @property
    def running(self) -> bool:
        return not all(c.closed for c in self.choices)

    async def next(self) -> tuple[Choice, Event]:
        """The next event of any choice, recorded on it; an end writes the choice's log line."""
        choice, e = await self._events.get()
        if isinstance(e, Chunk):
            choice.parts.append(e.text)
            if e.logprobs is not None and not self.p.stream:
                choice.scored = (choice.scored or []) + e.logprobs
        else:
            choice.end = e
            self._log_end(choice, e)
        return choice, e

    def abandon(self, finish: str) -> None:
        """End every choice still running (the client left, or a sibling failed): the engine drops
        its row within one step, and its slot is free at once (docs/ARCHITECTURE.md, decision 12)."""
        if self._rest is not None:
            self._rest.cancel()
        for c in self.choices:
            if not c.closed:
                self.engine.cancel(c.req.id)  # a row never submitted: the engine knows no such id
                c.slot.release()
                self._log_end(c, None, finish)

    async def run(self) -> Finished | Failed | None:
        """Read every choice to its end; the first failure (or cancel) ends the others and is returned."""
        while self.running:
            _, e = await self.next()
            if not isinstance(e, Chunk) and _failure(e):
                self.abandon("cancelled")
                return e
        return None

    def _usage(self) -> dict:
        """The prompt once (and the first choice's cached tokens), every choice's tokens."""
        ends = [c.end for c in self.choices if isinstance(c.end, Finished)]
        assert len(ends) == len(self.choices)
        return openai_api.usage(ends[0].prompt_tokens, sum(e.completion_tokens for e in ends), ends[0].cached_tokens)

    def completion(self) -> dict:
        """The non-streamed answer, once every choice has finished."""
        p, choices = self.p, []
        # The vocabulary's bytes are read from the header on first use (a third of a second on the
        # event loop for gemma3's 262,144 tokens): only when a choice has logprobs to shape.
        vocab = self.state.token_bytes() if any(c.scored is not None for c in self.choices) else []
        for c in self.choices:
            assert isinstance(c.end, Finished)
            content, calls = c.parser.parse(c.text) if c.parser is not None else (c.text, [])
            choices.append(
                openai_api.choice(
                    p,
                    c.index,
                    content,
                    tools.finish_reason(c.end.finish_reason, calls),
                    logprobs.shape(p.chat, c.scored, vocab),
                    calls,
                )
            )
        return openai_api.completion(p, self.rid, self.state.model_id, choices, self._usage(), self.fingerprint)

    def _piece_chunks(self, c: Choice, pieces: list[tools.Piece], shaped: dict | None) -> Iterator[str]:
        """The chunks for a stretch of a choice's output: text, or a call's deltas; its logprobs
        ride on the first (alone, while the parser holds the text back)."""
        p, rid, model = self.p, self.rid, self.state.model_id
        for piece in pieces or ([""] if shaped is not None else []):
            if isinstance(piece, str):
                yield _sse_data(
                    openai_api.chunk(p, rid, model, c.index, text=piece, logprobs=shaped, fingerprint=self.fingerprint)
                )
            else:
                assert c.parser is not None
                for delta in tools.call_deltas(piece, c.parser.calls.index(piece)):
                    yield _sse_data(
                        openai_api.chunk(
                            p, rid, model, c.index, tool_call=delta, logprobs=shaped, fingerprint=self.fingerprint
                        )
                    )
                    shaped = None
            shaped = None

    async def stream(self) -> AsyncIterator[str]:
        """The SSE body: each choice's chunks under its index as they come, its finish chunk when it
        ends, then the usage (when asked) and one [DONE] after all; a failure is an error event."""
        p, rid, model = self.p, self.rid, self.state.model_id
        try:
            if p.chat:
                for c in self.choices:
                    yield _sse_data(openai_api.chunk(p, rid, model, c.index, role=True, fingerprint=self.fingerprint))
            failure: Finished | Failed | None = None
            while self.running and failure is None:
                c, e = await self.next()
                if isinstance(e, Chunk):
                    vocab = self.state.token_bytes() if e.logprobs is not None else []
                    shaped = logprobs.shape(p.chat, e.logprobs, vocab, c.offset)
                    c.offset += len(e.text)
                    for data in self._piece_chunks(c, c.parser.feed(e.text) if c.parser else [e.text], shaped):
                        yield data
                elif _failure(e):
                    failure = e
                    self.abandon("cancelled")
                else:
                    for data in self._piece_chunks(c, c.parser.close() if c.parser else [], None):
                        yield data
                    finish = tools.finish_reason(e.finish_reason, c.parser.calls if c.parser else [])
                    yield _sse_data(
                        openai_api.chunk(p, rid, model, c.index, finish=finish, fingerprint=self.fingerprint)
                    )
            if failure is not None:  # the error the request would have had as a status, Retry-After in it
                error = _ended_error(self.state, failure)
                yield _sse_data({"error": {**error.body()["error"], "retry_after": error.retry_after}})
            elif p.include_usage:
                yield _sse_data(openai_api.chunk(p, rid, model, use=self._usage(), fingerprint=self.fingerprint))
            yield "data: [DONE]\n\n"
        finally:
            self.abandon("client_gone")  # the client went away mid-stream; once all have ended, nothing

    def _log_end(self, c: Choice, end: Finished | Failed | None, gone: str = "client_gone") -> None:
        """The one line per choice, however it ended: finished, cancelled, failed (finish=error:CODE),
        or abandoned (`gone`: client_gone, or cancelled for a failed sibling's); the prompt and output
        only with LOG_INPUT_TEXT."""
        state, req = self.state, c.req
        c.closed = True
        if isinstance(end, Finished):
            state.histograms.observe_ttft(state.model_id, end.ttft_s)
            state.histograms.observe_e2e(state.model_id, time.monotonic() - req.arrival)
            generated, ttft, rate, finish = end.completion_tokens, end.ttft_s, end.decode_tok_s, end.finish_reason
        else:  # the engine's live figures for a row that did not finish
            generated, ttft, rate = req.generated, req.ttft_s, req.decode_tok_s()
            finish = gone if end is None else f"error:{end.code}"
        log.info(
            "%s prompt=%d generated=%d queued=%.3fs ttft=%s decode=%s tok/s model=%s finish=%s",
            req.id,
            len(req.prompt_ids),
            generated,
            req.queued_s,
            "-" if ttft is None else f"{ttft:.3f}s",
            "-" if rate is None else f"{rate:.1f}",
            state.model_id,
            finish,
        )
        if state.settings.log_input_text:
            log.info(
                "%s input=%s output=%s",
                req.id,
                json.dumps(self.prompt_for_log, ensure_ascii=False),
                json.dumps(c.text, ensure_ascii=False),
            )
