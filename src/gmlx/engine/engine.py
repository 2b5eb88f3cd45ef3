"""The engine: one thread that owns every MLX call for one model (docs/ARCHITECTURE.md, decision 1).

Requests come in through a thread-safe command queue; their tokens go out through each
request's `emit` callback, called on this thread (the server hands them to its event loop).
Scheduling is mlx_lm's BatchGenerator: up to `decode_batch` streams decode together, and each
step prefills a chunk of every new prompt after the decode rows' token, the chunk sized each
step by engine/budget.py so that decoding never waits long behind a prefill. Its steps are
gmlx's (gmlx.upstream.own_steps): the decode step samples from the logits unnormalised, a
prompt's first token is sampled from the chunk that ends its prefill, a row joining or
leaving the decode batch takes or frees a slot, moving no other row's cache, and a row's first
token, and every row's last, go out before the step after is queued whole (`_hand_out_early`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import NamedTuple

import mlx.core as mx
import psutil
from mlx.utils import tree_flatten
from mlx_lm.generate import BatchGenerator, generation_stream
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.tokenizer_utils import StreamingDetokenizer

from gmlx import kernels, upstream
from gmlx.engine.budget import PrefillBudget
from gmlx.engine.embeddings import EmbedJob, embed
from gmlx.engine.grammar import GrammarProcessor
from gmlx.engine.logprobs import Scored, TokenLogprob, score_rows, token_logprob
from gmlx.engine.processors import Decoding, LogitsProcessor
from gmlx.engine.prompt_cache import MISS, Hit, PromptCache
from gmlx.engine.sampling import Sampler, SamplingParams, greedy, make_sampler, sample_rows
from gmlx.engine.speculative import SpeculativeCounters, SpeculativeStream, can_speculate
from gmlx.engine.stops import StopMatcher
from gmlx.gguf.detokenizer import continuation_detokenizer
from gmlx.heap import shed_stale_buffers, trim_heap
from gmlx.kernels import fast as kernels_fast
from gmlx.models.loader import LoadedModel

log = logging.getLogger("gmlx.engine")
_RATE_WINDOW_S = 10.0  # the "recent" in recent decode rates
_RECENT_REQUESTS = 32  # the "recent" in means over recent requests
WARMUP_TOKENS = 32


@dataclass
class Chunk:
    text: str
    logprobs: list[TokenLogprob] | None = None  # the tokens this text came from, for a request that asks


@dataclass
class Finished:
    finish_reason: str  # "stop", "length" or "cancelled"
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float | None  # from the request's arrival, queue wait included, as its client measures
    decode_tok_s: float | None
    cached_tokens: int = 0  # prompt tokens the prompt cache supplied
    queued_s: float = 0.0  # waiting at the server's admission gate


@dataclass
class Failed:
    message: str
    code: str = "generation_failed"  # the OpenAI error code the client gets


Event = Chunk | Finished | Failed


class Phase(StrEnum):
    """Where a request is: queued -> prefill -> decode -> done (strings, as snapshots show them)."""

    QUEUED = "queued"
    PREFILL = "prefill"
    DECODE = "decode"
    DONE = "done"


@dataclass
class Request:
    id: str
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    emit: Callable[[Event], None] = lambda _: None
    anchor_tokens: int = 0  # where a shared system prompt ends in prompt_ids (0: none)
    decoding: Decoding = Decoding()  # logit_bias, penalties and a grammar, applied to this row in the batch
    logprobs: int | None = None  # alternatives to report per token (0: the token's own only); None: no logprobs
    # Keep the cache just before the prompt's last token: the request's other choices (n > 1) start from it.
    keep_prompt: bool = False
    # Live state, written by the engine thread and read by snapshots.
    state: Phase = Phase.QUEUED
    uid: int | None = None
    submitted_at: float = field(default_factory=time.monotonic)
    # When the server received it, and how long it waited at the gate since (both the server's):
    # TTFT counts from arrival, as a client's does. None: it arrived when submitted.
    arrived_at: float | None = None
    queued_s: float = 0.0
    first_token_at: float | None = None
    last_token_at: float | None = None
    prefilled: int = 0
    generated: int = 0
    cache: Hit | None = None  # the prompt cache's answer, once the engine has asked it
    speculative: SpeculativeCounters | None = None  # with a drafter: its rounds for this request
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)  # scored, their text not yet emitted

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.arrival

    @property
    def arrival(self) -> float:
        return self.submitted_at if self.arrived_at is None else self.arrived_at

    @property
    def engine_ttft_s(self) -> float | None:
        """From submission to the first token: the engine's own time, no queue wait in it."""
        return None if self.first_token_at is None else self.first_token_at - self.submitted_at

    def decode_tok_s(self, now: float | None = None) -> float | None:
        if self.first_token_at is None or self.generated < 2:
            return None
        span = (now or time.monotonic()) - self.first_token_at
        return (self.generated - 1) / span if span > 0 else None


@dataclass(eq=False)
class _Stream:
    """A request's state on the engine thread, from its insertion into the batch to its end."""

    req: Request
    sampler: Sampler  # kept across handovers to and from the drafter's lane: its seed runs on
    detok: StreamingDetokenizer
    stops: StopMatcher
    checkpoints: dict[int, str]  # prompt position -> kind of cache to keep there, still to take
    grammar: GrammarProcessor | None = None  # the row's matcher, when a grammar holds its output
    draft_state: tuple | None = None  # the drafter's cache from the stream's last lane

    def whole_at(self, token: int) -> bool:
        """Whether a grammar holds the output and takes it, ending in `token`, as complete: max_tokens
        reached on the token that closed the JSON is a finish, not a cut."""
        length = len(self.req.prompt_ids) + self.req.generated
        return self.grammar is not None and self.grammar.accepts(length, token)


# Commands the engine thread takes from its queue.
@dataclass(frozen=True)
class _Submit:
    request: Request


@dataclass(frozen=True)
class _Cancel:
    request_id: str
    error: Failed | None


@dataclass(frozen=True)
class _ReleaseMemory:
    evict_bytes: int
    done: Callable[[int, int], None]


@dataclass(frozen=True)
class _Embed:
    job: EmbedJob


@dataclass(frozen=True)
class _CancelAll:
    pass


@dataclass(frozen=True)
class _Stop:
    pass


_Command = _Submit | _Cancel | _ReleaseMemory | _Embed | _CancelAll | _Stop


def drafting_refused(req: Request) -> str | None:
    """Why a request never decodes with the drafter, whose rounds apply no logits processor and
    score no alternatives (None: it may)."""
    if not req.decoding.plain:
        return "logits processors (bias, penalties or a grammar)"
    if req.logprobs is not None:
        return "logprobs"
    return None


def _split(tokens: list[int], start: int, cuts: list[int]) -> list[list[int]]:
    """tokens[start:] in segments that end at each cut (prefill stops there so a cache can be kept)."""
    bounds = [start, *(c for c in cuts if start < c < len(tokens)), len(tokens)]
    return [tokens[a:b] for a, b in zip(bounds, bounds[1:])]


def _mean(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


@dataclass
class EngineStats:
    """Figures the server reports and plans with; written only by the engine thread."""

    finished: int = 0
    generated_total: int = 0  # by finished requests, for the mean per request
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    recent_steps: deque = field(default_factory=lambda: deque(maxlen=4096))  # (t, decode tokens)
    recent_prefills: deque = field(default_factory=lambda: deque(maxlen=64))  # (tokens, seconds) a prefill step
    # Per finished request: (decode tok/s, prefill tok/s), for the means over recent requests.
    recent_requests: deque = field(default_factory=lambda: deque(maxlen=_RECENT_REQUESTS))
    decode_rate_sum: float = 0.0  # over finished requests that decoded, for the lifetime mean
    decode_rate_count: int = 0
    finish_reasons: Counter = field(default_factory=Counter)
    speculative: SpeculativeCounters = field(default_factory=SpeculativeCounters)  # lifetime, with a drafter

    def record(self, req: Request, event: Finished) -> None:
        self.finish_reasons[event.finish_reason] += 1
        if req.speculative is not None:
            self.speculative.add(req.speculative)
        if event.finish_reason == "cancelled":
            return
        self.finished += 1
        self.generated_total += req.generated
        cold = len(req.prompt_ids) - (req.cache.warm_tokens if req.cache else 0)  # what was really prefilled
        prefill = cold / req.engine_ttft_s if req.engine_ttft_s else None  # the queue wait is no prefill
        self.recent_requests.append((event.decode_tok_s, prefill))
        if event.decode_tok_s is not None:
            self.decode_rate_sum += event.decode_tok_s
            self.decode_rate_count += 1

    def request_means(self) -> tuple[float | None, float | None]:
        """Mean decode and prefill tok/s of the recent finished requests, each stream on its own."""
        rows = list(self.recent_requests)
        return _mean(r[0] for r in rows), _mean(r[1] for r in rows)

    def decode_tok_s_per_request_lifetime(self) -> float | None:
        return self.decode_rate_sum / self.decode_rate_count if self.decode_rate_count else None

    def mean_generated(self) -> float | None:
        return self.generated_total / self.finished if self.finished else None

    def decode_tok_s_recent(self, now: float | None = None) -> float | None:
        """Aggregate decode tokens per second over the last few seconds, all streams together."""
        now = now or time.monotonic()
        steps = [(t, n) for t, n in list(self.recent_steps) if now - t <= _RATE_WINDOW_S]
        if len(steps) < 2:
            return None
        span = steps[-1][0] - steps[0][0]
        return sum(n for _, n in steps[1:]) / span if span > 0 else None

    def decode_tok_s_lifetime(self) -> float | None:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else None

    def prefill_tok_s(self) -> float | None:
        return self.prefill_tokens / self.prefill_seconds if self.prefill_seconds > 0 else None


@dataclass(frozen=True)
class Measured:
    """What a short warm-up at start measured, to show beside what capacity predicts."""

    tokens: int  # prompt tokens of the warm-up stream
    kv_bytes: int  # MLX active memory its cache took (caches allocate in 256-token steps)
    kv_dtype_bytes: int  # the cache's float element size (its store, a quantized cache's scales)
    prefill_tok_s: float
    decode_tok_s: float
    # Working memory above the cache at the peak of a prefill from an empty cache, run as the
    # engine runs a chunk: of `tokens` tokens, and of twice as many (what each token adds:
    # capacity.table.prefill_growth).
    prefill_peak_bytes: int
    doubled_prefill_peak_bytes: int
    # What the longer prefill needed of the CPU kernels' scratch, outside MLX's buffers (0 where
    # they do not run).
    prefill_scratch_bytes: int
    # Resident memory outside MLX's buffers once the warm-up is done and the heap trimmed: the
    # interpreter, libraries and tokenizer. Where MLX's buffers live on a device (CUDA) it is no
    # figure of the budget's (capacity.table.governor_terms).
    host_bytes: int = 0


def memory_outside_mlx() -> int:
    """This process's resident memory outside MLX's buffers (active and cached)."""
    return max(0, psutil.Process().memory_info().rss - mx.get_active_memory() - mx.get_cache_memory())


CacheFactory = Callable[[object], list]  # model -> one request's per-layer caches


def _float_bytes(cache: list) -> int:
    """The widest float element the caches hold (float16 where the kernels run attention)."""
    arrays = [a for _, a in tree_flatten([c.state for c in cache]) if isinstance(a, mx.array)]
    return max((a.dtype.size for a in arrays if mx.issubdtype(a.dtype, mx.floating)), default=4)


class _Prefill(NamedTuple):
    """What `_measured_prefill` measured."""

    kv_bytes: int  # what the cache took
    peak_bytes: int  # the working memory above it at the peak, in MLX's buffers
    seconds: float
    scratch_bytes: int  # what it needed of the CPU kernels' scratch


def _measured_prefill(model: object, make_cache: CacheFactory, token: int, tokens: int) -> tuple[list, _Prefill]:
    """A fresh cache prefilled with `tokens` copies of `token` as the engine prefills a chunk (layer
    by layer, the logits of the last position alone), and what that measured."""
    mx.synchronize()
    mx.clear_cache()
    kernels.release_scratch()
    before = mx.get_active_memory()
    mx.reset_peak_memory()  # to 0, not to `before`: subtract it below
    cache = make_cache(model)
    start = time.perf_counter()
    with upstream.layer_by_layer(model):
        logits = upstream.logits_at(model, mx.array([[token] * tokens]), cache, [0], [tokens - 1])
    mx.eval(logits, [c.state for c in cache])
    seconds = time.perf_counter() - start
    del logits
    mx.clear_cache()
    kv = mx.get_active_memory() - before
    return cache, _Prefill(kv, max(0, mx.get_peak_memory() - before - kv), seconds, kernels.scratch_bytes(used=True))


def warm_up(
    loaded: LoadedModel,
    tokens: int = WARMUP_TOKENS,
    decode_steps: int = 4,
    make_cache: CacheFactory = make_prompt_cache,
) -> Measured:
    """Prefill a few tokens and decode a few more on one stream: times both, and measures the
    cache's bytes and the prefill's working memory, then the working memory of a prefill twice as
    long. Short on purpose: MLX's quantized CPU kernels prefill at a few tok/s."""
    tokens = max(1, min(tokens, (loaded.context_length - decode_steps - 1) // 2))
    model, token = loaded.model, loaded.tokenizer.bos_token_id or 0
    # A model's first forward pass keeps one-time buffers (constants built lazily, kernel scratch):
    # pay for them before measuring, or they count as KV.
    mx.eval(model(mx.array([[token]]), cache=make_cache(model)))
    cache, short = _measured_prefill(model, make_cache, token, tokens)
    dtype_bytes = _float_bytes(cache)
    step = mx.array([[token]])
    start = time.perf_counter()
    for _ in range(decode_steps):
        mx.eval(model(step, cache=cache))
    decode_s = time.perf_counter() - start
    del cache
    doubled = _measured_prefill(model, make_cache, token, 2 * tokens)[1]
    mx.clear_cache()
    trim_heap()  # what loading freed is no part of what the process keeps
    return Measured(
        tokens,
        short.kv_bytes,
        dtype_bytes,
        tokens / short.seconds,
        decode_steps / decode_s,
        short.peak_bytes,
        doubled.peak_bytes,
        doubled.scratch_bytes,
        memory_outside_mlx(),
    )


def _kernel_streams() -> list[mx.Stream]:
    """The calling thread's CPU streams the kernels run on (none where they do not run): its
    default (the warm-up, embeddings) and mlx_lm's generation stream (the batch)."""
    if not kernels.available():
        return []
    default = mx.default_stream(mx.cpu)
    with mx.stream(generation_stream):
        generation = mx.default_stream(mx.cpu)
    return [default] if generation == default else [default, generation]


def _release_thread_state() -> None:
    """Free what MLX keeps for the calling thread (its streams, its random key, its mx.compile
    cache) while Python can still free the Python objects among them: the engine thread's last act
    (docs/ARCHITECTURE.md, decision 1). MLX frees them as the thread ends, taking the GIL, and a
    process exiting meanwhile aborts ("terminate called without an active exception"). The compile
    cache is reached through gmlx's extension; where it is not built, that one stays."""
    mx.clear_streams()
    if (ext := kernels.extension()) is not None:
        ext.clear_compile_cache()


class Engine:
    """Serves one model. `load` runs on the engine thread too, so that thread owns the
    model's arrays from the start; `ready` is set once it has returned."""

    def __init__(
        self,
        load: Callable[[], LoadedModel],
        name: str,
        decode_batch: int = 8,
        prefill_step: int = 512,
        make_cache: CacheFactory = make_prompt_cache,
        prompt_cache: PromptCache | None = None,
        checkpoint_every: int = 1024,
        load_draft: Callable[[LoadedModel], LoadedModel] | None = None,
        num_draft: int = 3,
    ):
        self._load = load
        self._make_cache = make_cache  # fresh caches for a request (quantized KV plugs in here)
        self.prompt_cache = prompt_cache if prompt_cache is not None and prompt_cache.enabled else None
        self.checkpoint_every = checkpoint_every
        self._trim_limit: float = float("inf")  # tokens past which a request's caches cannot be trimmed
        self._load_draft = load_draft  # loads and checks the drafter against the served model
        self.draft: LoadedModel | None = None
        self.num_draft = num_draft
        self._lane: tuple[_Stream, SpeculativeStream] | None = None  # the one stream decoding with the drafter
        self._no_lane: str | None = None  # why this model's caches cannot decode speculatively at all
        self.loaded: LoadedModel | None = None
        self.measured: Measured | None = None
        self.load_error: str | None = None
        self.ready = threading.Event()
        self.decode_batch = decode_batch
        self.prefill_step = prefill_step
        self._budget = PrefillBudget(prefill_step)
        self._decoded_last: frozenset[int] = frozenset()  # rows the last step decoded
        self._prefilled = False  # prompt work ran since the kernels' scratch was last released
        self._early: list = []  # this step's responses handed out already (_hand_out_early)
        self.stats = EngineStats()
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._active: dict[int, _Stream] = {}  # batch uid -> stream, owned by the engine thread
        self._embedding: deque[EmbedJob] = deque()  # waiting embeddings, first served first; engine thread
        self._requests: dict[str, Request] = {}  # id -> request, for snapshots and cancels
        self._lock = threading.Lock()
        self._sampling_failed: list[tuple[Request, str]] = []  # this step's, engine thread only
        # Called on this thread with the seconds between each two tokens a stream emits (the
        # server's inter-token latency histogram); it must be thread-safe and quick.
        self.on_token_gap: Callable[[float], None] | None = None
        self._thread = threading.Thread(target=self._run, name=f"engine-{name}", daemon=True)

    # --- called from any thread -------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread, first setting what it needs process-wide: MLX's fast ops as
        gmlx's CPU kernels (gmlx.kernels.fast; nothing off the CPU or without the extension). Large
        buffers go straight back to the system from gmlx's import on (gmlx/heap.py)."""
        kernels_fast.install()
        self._thread.start()

    def submit(self, request: Request) -> None:
        with self._lock:
            self._requests[request.id] = request
        self._commands.put(_Submit(request))

    def cancel(self, request_id: str, error: Failed | None = None) -> None:
        """Stop a request within one step; its slot and KV cache are freed. With an `error`
        the request ends with it, so its client learns why it was stopped."""
        self._commands.put(_Cancel(request_id, error))

    def release_memory(self, evict_bytes: int, done: Callable[[int, int], None]) -> None:
        """The governor's release, on the engine thread (neither step is a memory read): drop the
        prompt cache's least recently used entries until `evict_bytes` are freed, release MLX's
        buffer cache, and trim the heap, which now holds those buffers' pages. `done(evicted,
        released)` is then called here with the bytes of the entries dropped and the bytes MLX's
        cache returned to the system (which include the dropped entries' buffers)."""
        self._commands.put(_ReleaseMemory(evict_bytes, done))

    def embed(
        self, inputs: list[list[int]], pooling: str, done: Callable[[list[list[float]] | None, str | None], None]
    ) -> EmbedJob:
        """Embed each token list (engine/embeddings.py), one per engine iteration between decode
        steps; `done` is called on this thread once all are, unless the job is cancelled first."""
        job = EmbedJob(inputs, pooling, done)
        self._commands.put(_Embed(job))
        return job

    def cancel_all(self) -> None:
        self._commands.put(_CancelAll())

    def stop(self, timeout: float = 5.0) -> None:
        self._commands.put(_Stop())
        self._thread.join(timeout)

    def requests(self) -> list[Request]:
        with self._lock:
            return list(self._requests.values())

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._requests)

    @property
    def decoding(self) -> int:
        return sum(1 for r in self.requests() if r.state == Phase.DECODE)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # --- the engine thread ---------------------------------------------------------------

    def _new_generator(self) -> BatchGenerator:
        assert self.loaded is not None
        eos = [[t] for t in sorted(self.loaded.tokenizer.eos_token_ids)]
        gen = BatchGenerator(
            self.loaded.model,
            stop_tokens=eos,
            completion_batch_size=self.decode_batch,
            prefill_batch_size=self.decode_batch,
            prefill_step_size=self.prefill_step,
            sampler=greedy,  # a free slot's: the same object as greedy rows', so a batch of them samples in one call
        )
        upstream.own_steps(
            gen,
            self._score,
            self._keeps_last_apart,
            sample_rows,
            lambda rs: self._hand_out_early(gen, rs),
            least_chunk=self._budget.least_chunk,
        )
        return gen

    def _score(self, logits: mx.array, tokens: mx.array, uids: list[int]) -> list[Scored | None]:
        """The rows' scores, for the requests that ask for logprobs (a response's `logprobs`)."""
        streams = [self._active.get(uid) for uid in uids]
        return score_rows(logits, tokens, [s.req.logprobs if s is not None else None for s in streams])

    def _keeps_last_apart(self, uid: int) -> bool:
        """Whether the cache just before the prompt's last token is kept (a checkpoint there)."""
        stream = self._active.get(uid)
        return stream is not None and len(stream.req.prompt_ids) - 1 in stream.checkpoints

    def _run(self) -> None:
        try:
            self._serve()
        finally:
            _release_thread_state()

    def _serve(self) -> None:
        try:
            self.loaded = self._load()
            if self._load_draft is not None:
                self.draft = self._load_draft(self.loaded)
                self._no_lane = can_speculate(self._make_cache(self.loaded.model))
                if self._no_lane:
                    log.warning("the drafter stays idle: %s", self._no_lane)
            self.measured = warm_up(self.loaded, make_cache=self._make_cache)
            # First guesses for the prefill budget, until steps beside decoding are measured.
            self._budget.decode_s = 1 / self.measured.decode_tok_s
            self._budget.token_s = 1 / self.measured.prefill_tok_s
            windows = [w for c in self._make_cache(self.loaded.model) if (w := getattr(c, "max_size", None))]
            self._trim_limit = min(windows, default=float("inf"))
        except Exception as e:
            log.exception("loading the model failed")
            self.load_error = str(e)
            self.loaded = self.draft = None  # not ready: nothing will serve it
            return
        finally:
            self.ready.set()
        gen = self._new_generator()
        while True:
            try:
                if not self._take_commands(gen, block=not (self._active or self._embedding)):
                    break
                if self._lane is None and self._may_speculate():
                    self._enter_lane(gen)
                shed_stale_buffers()  # so that the next step finds its buffers in MLX's cache
                if self._lane is not None:
                    self._lane_round(gen)
                elif self._active:
                    self._step(gen)
                if self._embedding:
                    self._embed_next()
                self._release_prompt_scratch()
            except Exception as e:  # the thread must outlive any one request's failure
                log.exception("engine step failed; failing %d request(s) and starting afresh", len(self._active))
                self._lane = None
                for stream in list(self._active.values()):
                    self._finish(stream.req, Failed(f"generation failed: {e}"))
                gen = self._new_generator()
        for stream in list(self._active.values()):
            self._finish(stream.req, self._cancelled(stream.req))
        self._end_embeddings("the engine stopped")
        gen.close()

    def _release_prompt_scratch(self) -> None:
        """Once no prompt is left to prefill, let the kernels free the scratch the prompts grew: the
        next step keeps what decoding needs, and an engine left idle keeps none (docs/ARCHITECTURE.md,
        decision 39)."""
        if self._prefilled and not self._embedding and all(s.req.state != Phase.PREFILL for s in self._active.values()):
            kernels.release_scratch(_kernel_streams())
            self._prefilled = False

    def _cancel(self, gen: BatchGenerator, req: Request, error: Failed | None = None) -> None:
        if self._lane is not None and self._lane[0].req is req:
            self._lane = None
        gen.remove([req.uid])
        self._finish(req, error or self._cancelled(req))

    @staticmethod
    def _cancelled(req: Request) -> Finished:
        return Finished(
            "cancelled",
            len(req.prompt_ids),
            req.generated,
            req.ttft_s,
            req.decode_tok_s(),
            req.cache.warm_tokens if req.cache else 0,
            req.queued_s,
        )

    def _take_commands(self, gen: BatchGenerator, block: bool) -> bool:
        """Apply waiting commands; False once asked to stop."""
        while True:
            try:
                command = self._commands.get(block=block)
            except queue.Empty:
                return True
            block = False
            match command:
                case _Stop():
                    return False
                case _Submit(request):
                    self._leave_lane(gen)  # the drafter cannot join a batch: the lane's stream goes back
                    self._insert(gen, request)
                case _Cancel(request_id, error):
                    req = self._requests.get(request_id)
                    if req is not None and req.uid in self._active:
                        self._cancel(gen, req, error)
                case _ReleaseMemory(evict_bytes, done):
                    evicted = self.prompt_cache.evict_coldest(evict_bytes) if self.prompt_cache is not None else 0
                    released = mx.get_cache_memory()
                    mx.clear_cache()
                    trim_heap()
                    try:
                        done(evicted, released)
                    except Exception:  # a report that fails must not fail the running requests
                        log.exception("reporting a memory release failed")
                case _Embed(job):
                    self._embedding.append(job)
                case _CancelAll():
                    for stream in list(self._active.values()):
                        self._cancel(gen, stream.req)
                    self._end_embeddings("cancelled: the server is shutting down")

    def _embed_next(self) -> None:
        """Run the first waiting embedding's next input; answer it once its last has run."""
        job = self._embedding[0]
        self._prefilled = True
        if not job.cancelled:
            assert self.loaded is not None and job.next_input is not None  # a finished job is gone
            try:
                job.vectors.append(embed(self.loaded, self._make_cache, job.next_input, job.pooling, self.prefill_step))
            except Exception as e:  # a failed embedding fails its request, not the engine
                log.exception("embedding failed")
                self._embedding.popleft()
                self._deliver(job, None, f"embedding failed: {e}")
                return
            if job.next_input is not None:
                return
            self._deliver(job, job.vectors, None)
        self._embedding.popleft()

    def _end_embeddings(self, why: str) -> None:
        while self._embedding:
            job = self._embedding.popleft()
            if not job.cancelled:
                self._deliver(job, None, why)

    @staticmethod
    def _deliver(job: EmbedJob, vectors: list[list[float]] | None, error: str | None) -> None:
        try:
            job.done(vectors, error)
        except Exception:  # as for a memory release's report: the running requests must not fail for it
            log.exception("delivering embeddings failed")

    def _insert(self, gen: BatchGenerator, req: Request) -> None:
        assert self.loaded is not None
        if not req.prompt_ids or req.max_tokens < 1:
            self._finish(req, Failed("empty prompt or max_tokens < 1"))
            return
        try:
            hit, cache = self.prompt_cache.fetch(req.prompt_ids) if self.prompt_cache is not None else (MISS, None)
            processors = req.decoding.processors(len(req.prompt_ids))
            stream = _Stream(
                req,
                self._guarded_sampler(req),
                continuation_detokenizer(self.loaded.tokenizer, req.prompt_ids),
                StopMatcher(req.stop),
                self._checkpoint_plan(req, hit.warm_tokens),
                next((p for p in processors if isinstance(p, GrammarProcessor)), None),
            )
            [uid] = gen.insert_segments(
                [_split(req.prompt_ids, hit.warm_tokens, sorted(stream.checkpoints))],
                [req.max_tokens],
                caches=[cache or self._make_cache(self.loaded.model)],
                all_tokens=[req.prompt_ids[: hit.warm_tokens]],
                samplers=[stream.sampler],
                logits_processors=[self._guarded(req, processors)],
            )
        except Exception as e:  # not yet active, so the loop's handler would not end it: it would hang
            log.exception("request %s: starting it failed", req.id)
            self._finish(req, Failed(f"generation failed: {e}"))
            return
        req.uid, req.state, req.cache, req.prefilled = uid, Phase.PREFILL, hit, hit.warm_tokens
        if self.draft is not None:
            req.speculative = SpeculativeCounters()
        self._active[uid] = stream

    def _checkpoint_plan(self, req: Request, warm: int) -> dict[int, str]:
        """Prompt positions at which to keep the cache while prefilling, and of what kind.

        An anchor where a shared system prompt ends. Where the caches cannot be trimmed back
        (sliding layers past their window), a checkpoint every `checkpoint_every` tokens and one
        just before the last prompt token, since the request's final cache will not trim to them.
        With `keep_prompt`, that last one always: the choices that follow find the prompt there
        while this one still decodes.
        """
        if self.prompt_cache is None:
            return {}
        last = len(req.prompt_ids) - 1
        plan: dict[int, str] = {}
        if last + req.max_tokens >= self._trim_limit:
            plan = {p: "ckpt" for p in range(self.checkpoint_every, last, self.checkpoint_every)}
            plan[last] = "ckpt"
        if req.keep_prompt:
            plan[last] = "ckpt"
        if 0 < req.anchor_tokens < last:
            plan[req.anchor_tokens] = "anchor"
        return {p: kind for p, kind in plan.items() if p > warm}

    def _take_checkpoint(self, gen: BatchGenerator, stream: _Stream, position: int) -> None:
        kind = stream.checkpoints.pop(position, None)
        if kind is None or self.prompt_cache is None:
            return
        for cache, tokens in gen.extract_cache([stream.req.uid]).values():
            self.prompt_cache.store(tokens, cache, kind)

    def _keep_final(self, cache: list | None, tokens: list[int] | None) -> None:
        if self.prompt_cache is not None and cache is not None and tokens:
            self.prompt_cache.store(list(tokens), cache, "final")

    def _guarded_sampler(self, req: Request) -> Sampler:
        """The request's sampler, made to fail that request alone (sampling.Draw's on_error)."""

        def failed(e: Exception) -> None:
            log.error("request %s: sampling failed", req.id, exc_info=e)
            self._sampling_failed.append((req, str(e)))

        return make_sampler(req.sampling, on_error=failed)

    def _guarded(self, req: Request, processors: list[LogitsProcessor]) -> list[LogitsProcessor]:
        """The request's logits processors, each made to fail that request alone as its sampler is."""

        def guarded(processor: LogitsProcessor) -> LogitsProcessor:
            def process(tokens: mx.array, logits: mx.array) -> mx.array:
                try:
                    return processor(tokens, logits)
                except Exception as e:
                    log.exception("request %s: a logits processor failed", req.id)
                    self._sampling_failed.append((req, str(e)))
                    return logits

            return process

        return [guarded(p) for p in processors]

    # --- speculative decoding: one request alone, with the drafter --------------------------

    def _may_speculate(self) -> bool:
        if self.draft is None or self._no_lane or len(self._active) != 1 or not self._commands.empty():
            return False
        [stream] = self._active.values()
        req = stream.req
        if drafting_refused(req) is not None:
            return False
        # Leaving the batch costs a step: not for a request about to end, or about to reach a
        # sliding window (past it, rejected drafts could not be trimmed back).
        length = len(req.prompt_ids) + req.generated
        return (
            req.state == Phase.DECODE
            and req.generated >= 1
            and req.max_tokens - req.generated > self.num_draft
            and length + self.num_draft < self._trim_limit
        )

    def _enter_lane(self, gen: BatchGenerator) -> None:
        assert self.loaded is not None and self.draft is not None
        [stream] = self._active.values()
        req = stream.req
        [(cache, tokens)] = gen.remove([req.uid], return_prompt_caches=True).values()
        lane = SpeculativeStream.from_batch(
            self.loaded.model,
            self.draft.model,
            cache,
            tokens,
            sampler=stream.sampler,
            num_draft=self.num_draft,
            prefill_step=self.prefill_step,
            draft_state=stream.draft_state,
        )
        stream.draft_state = None
        assert req.speculative is not None
        lane.counters = req.speculative  # the row shows the request's figures live
        self._lane = (stream, lane)

    def _lane_round(self, gen: BatchGenerator) -> None:
        assert self._lane is not None and self.loaded is not None
        stream, lane = self._lane
        req = stream.req
        start = time.perf_counter()
        tokens = lane.round(req.max_tokens - req.generated, self.loaded.tokenizer.eos_token_ids)
        now, st = time.monotonic(), self.stats
        st.decode_tokens += len(tokens)
        st.decode_seconds += time.perf_counter() - start
        st.recent_steps.append((now, len(tokens)))
        if self._sampling_failed:
            self._sampling_failed.clear()
            self._lane = None
            self._finish(req, Failed("sampling failed"))
            return
        eos = self.loaded.tokenizer.eos_token_ids
        for token in tokens:
            finish = "stop" if token in eos else "length" if req.generated + 1 >= req.max_tokens else None
            self._on_token(gen, stream, token, finish, now)
            if req.state == Phase.DONE:
                self._lane = None
                self._keep_final(lane.cache, lane.history)
                return
        if lane.reason() is not None:  # its sliding window is near: trimming back would no longer be exact
            self._leave_lane(gen)

    def _leave_lane(self, gen: BatchGenerator) -> None:
        if self._lane is None:
            return
        stream, lane = self._lane
        self._lane = None
        self._rejoin(gen, stream, *lane.release())
        if lane.draft_state is not None:  # a later lane catches the drafter up instead of prefilling it
            stream.draft_state = lane.draft_state

    def _rejoin(
        self, gen: BatchGenerator, stream: _Stream, cache: list, history: list[int], pending: list[int]
    ) -> None:
        """Put a decoding stream back in the batch under a new uid; the batch decodes on from `pending`."""
        req = stream.req
        [uid] = gen.insert(
            [pending], [req.max_tokens - req.generated], caches=[cache], all_tokens=[history], samplers=[stream.sampler]
        )
        del self._active[req.uid]
        req.uid = uid
        self._active[uid] = stream
        stream.checkpoints = {}
        assert req.speculative is not None
        req.speculative.batched = True

    def _step(self, gen: BatchGenerator) -> None:
        phases = Counter(stream.req.state for stream in self._active.values())
        decoding, prefilling = phases[Phase.DECODE], phases[Phase.PREFILL]
        # Prompts join the batch only while it has room (mlx_lm's completion_batch_size).
        gen.prefill_step_size = self._budget.chunk(decoding, min(prefilling, self.decode_batch - decoding))
        start = time.perf_counter()
        with gen.stats() as s:
            prompt_responses, generation_responses = gen.next()
        seconds = time.perf_counter() - start
        # A step in which rows joined the decode batch, or the first after rows joined or left it,
        # may also move every row's KV cache (a join with no free slot to take, free slots gathered
        # out: upstream._slotted_batch): 3-10 decode steps' time. Learning from such a step, the
        # budget once let 100-token chunks through for seconds after.
        rows = frozenset(r.uid for r in generation_responses)
        joined = any(p.end_of_prompt for p in prompt_responses)
        if rows == self._decoded_last and not joined:
            self._budget.observe(len(rows), s.prompt_tokens, seconds)
        self._decoded_last = rows
        while self._sampling_failed:  # before the responses, so no placeholder token goes out
            req, why = self._sampling_failed.pop()
            if req.uid in self._active:
                self._cancel(gen, req, Failed(f"sampling failed: {why}"))
        now = time.monotonic()
        st = self.stats
        st.prefill_tokens += s.prompt_tokens
        st.prefill_seconds += s.prompt_time
        if s.prompt_tokens:
            st.recent_prefills.append((s.prompt_tokens, s.prompt_time))
            self._prefilled = True
        if self.draft is not None and len(generation_responses) > 1:  # decoding together, without the drafter
            for r in generation_responses:
                if (stream := self._active.get(r.uid)) is not None and stream.req.speculative is not None:
                    stream.req.speculative.batched = True
        if generation_responses:  # their tokens were counted as they were handed out
            st.decode_seconds += s.decode_time
            st.recent_steps.append((now, len(generation_responses)))

        for p in prompt_responses:
            if (stream := self._active.get(p.uid)) is not None and stream.req.state == Phase.PREFILL:
                req = stream.req
                warm = req.cache.warm_tokens if req.cache else 0
                req.prefilled = warm + p.progress[0]
                if p.end_of_segment and not p.end_of_prompt:
                    self._take_checkpoint(gen, stream, req.prefilled)
                if p.end_of_prompt:
                    req.state = Phase.DECODE
        early, self._early = self._early, []
        handed = {id(r) for r in early}  # `early` holds them, so no id is reused meanwhile
        self._hand_out(gen, [r for r in generation_responses if id(r) not in handed])

    def _hand_out_early(self, gen: BatchGenerator, responses: list) -> None:
        """The decode batch's responses, handed out as soon as their tokens are read
        (upstream.own_steps); the step's own loop skips them. A row answered in its prefill
        (max_tokens 1) is not among them: its token was sampled in this step, so it waits for
        the check of `_sampling_failed`, lest a failed sampler's placeholder go out."""
        self._early += responses
        self._hand_out(gen, responses)

    def _hand_out(self, gen: BatchGenerator, responses: list) -> None:
        """Hand each response's token to its request, counted first: a client that reads the
        metrics once its request ends finds its tokens in them."""
        self.stats.decode_tokens += len(responses)
        now = time.monotonic()
        for r in responses:
            if (stream := self._active.get(r.uid)) is not None:
                if r.finish_reason is not None:
                    self._keep_final(r.prompt_cache, r.all_tokens)
                want = stream.req.logprobs
                scored = token_logprob(r.logprobs, r.token, want) if want is not None and r.logprobs else None
                self._on_token(gen, stream, r.token, r.finish_reason, now, scored)

    def _on_token(
        self,
        gen: BatchGenerator,
        stream: _Stream,
        token: int,
        finish_reason: str | None,
        now: float,
        logprob: TokenLogprob | None = None,
    ) -> None:
        req = stream.req
        if req.first_token_at is None:
            req.first_token_at, req.state = now, Phase.DECODE
        elif finish_reason != "stop" and self.on_token_gap is not None:  # an EOS token is never sent
            self.on_token_gap(now - req.last_token_at)  # type: ignore[operator]
        req.last_token_at = now
        detok, stops = stream.detok, stream.stops
        if finish_reason != "stop":  # "stop" here means an EOS token, which has no text
            req.generated += 1
            detok.add_token(token)
            if logprob is not None:
                req.pending_logprobs.append(logprob)
        if finish_reason is not None:
            detok.finalize()
        text, hit = stops.feed(detok.last_segment)
        if finish_reason is not None and not hit:
            text += stops.flush()
        if text:
            scored, req.pending_logprobs = req.pending_logprobs, []
            self._emit(req, Chunk(text, scored if req.logprobs is not None else None))
        if hit and finish_reason is None:
            for cache, tokens in gen.remove([req.uid], return_prompt_caches=self.prompt_cache is not None).values():
                self._keep_final(cache, tokens)
        if hit or finish_reason is not None:
            reason = "stop" if hit or (finish_reason == "length" and stream.whole_at(token)) else finish_reason
            self._finish(
                req,
                Finished(
                    reason,
                    len(req.prompt_ids),
                    req.generated,
                    req.ttft_s,
                    req.decode_tok_s(now),
                    req.cache.warm_tokens if req.cache else 0,
                    req.queued_s,
                ),
            )

    def _finish(self, req: Request, event: Event) -> None:
        if isinstance(event, Finished):
            self.stats.record(req, event)
        else:  # a failure is a finish too: the counts would otherwise hide every error
            self.stats.finish_reasons["error"] += 1
        req.state = Phase.DONE
        self._active.pop(req.uid, None)
        with self._lock:
            self._requests.pop(req.id, None)
        self._emit(req, event)

    @staticmethod
    def _emit(req: Request, event: Event) -> None:
        try:
            req.emit(event)
        except Exception:  # a consumer that went away must not stop the engine
            log.exception("request %s: delivering an event failed", req.id)
