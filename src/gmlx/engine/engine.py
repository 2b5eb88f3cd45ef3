"""The engine: one thread that owns every MLX call for one model (DESIGN.md, decision 1).

Requests come in through a thread-safe command queue; their tokens go out through each
request's `emit` callback, called on this thread (the server hands them to its event loop).
Scheduling is mlx_lm's BatchGenerator: up to `decode_batch` streams decode together and new
prompts are prefilled in `prefill_step`-token chunks between decode steps.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import greedy_sampler

from gmlx.engine.sampling import Sampler, SamplingParams, make_sampler
from gmlx.engine.stops import StopMatcher
from gmlx.models.loader import LoadedModel

log = logging.getLogger("gmlx.engine")
_RATE_WINDOW_S = 10.0  # the "recent" in recent decode rates
_RECENT_REQUESTS = 32  # the "recent" in means over recent requests
WARMUP_TOKENS = 32


@dataclass
class Chunk:
    text: str


@dataclass
class Finished:
    finish_reason: str  # "stop", "length" or "cancelled"
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float | None
    decode_tok_s: float | None


@dataclass
class Failed:
    message: str
    code: str = "generation_failed"  # the OpenAI error code the client gets


Event = Chunk | Finished | Failed


@dataclass
class Request:
    id: str
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    emit: Callable[[Event], None] = lambda _: None
    # Live state, written by the engine thread and read by snapshots.
    state: str = "queued"  # queued -> prefill -> decode -> done
    uid: int | None = None
    submitted_at: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    prefilled: int = 0
    generated: int = 0

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.submitted_at

    def decode_tok_s(self, now: float | None = None) -> float | None:
        if self.first_token_at is None or self.generated < 2:
            return None
        span = (now or time.monotonic()) - self.first_token_at
        return (self.generated - 1) / span if span > 0 else None


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
    # Per finished request: (decode tok/s, prefill tok/s), for the means over recent requests.
    recent_requests: deque = field(default_factory=lambda: deque(maxlen=_RECENT_REQUESTS))
    decode_rate_sum: float = 0.0  # over finished requests that decoded, for the lifetime mean
    decode_rate_count: int = 0
    finish_reasons: Counter = field(default_factory=Counter)

    def record(self, req: Request, event: Finished) -> None:
        self.finish_reasons[event.finish_reason] += 1
        if event.finish_reason == "cancelled":
            return
        self.finished += 1
        self.generated_total += req.generated
        prefill = len(req.prompt_ids) / event.ttft_s if event.ttft_s else None
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
    kv_dtype_bytes: int  # element size of the cache, as the model computes
    prefill_tok_s: float
    decode_tok_s: float
    prefill_peak_bytes: int  # working memory above the cache while prefilling


CacheFactory = Callable[[object], list]  # model -> one request's per-layer caches


def warm_up(loaded: LoadedModel, tokens: int = WARMUP_TOKENS, decode_steps: int = 4,
            make_cache: CacheFactory = make_prompt_cache) -> Measured:
    """Prefill a few tokens and decode a few more on one stream: times both, and measures the
    cache's bytes. Short on purpose: MLX's quantized CPU kernels prefill at a few tok/s."""
    tokens = max(1, min(tokens, loaded.context_length - decode_steps - 1))
    prompt = mx.array([[loaded.tokenizer.bos_token_id or 0] * tokens])
    mx.synchronize()
    mx.clear_cache()
    before = mx.get_active_memory()
    mx.reset_peak_memory()  # to 0, not to `before`: subtract it below
    cache = make_cache(loaded.model)
    start = time.perf_counter()
    logits = loaded.model(prompt, cache=cache)
    mx.eval(logits[:, -1], [c.state for c in cache])
    prefill_s = time.perf_counter() - start
    dtype_bytes = logits.dtype.size
    del logits
    mx.clear_cache()
    kv = mx.get_active_memory() - before
    peak = mx.get_peak_memory() - before - kv
    token = mx.array([[prompt[0, 0].item()]])
    start = time.perf_counter()
    for _ in range(decode_steps):
        mx.eval(loaded.model(token, cache=cache))
    decode_s = time.perf_counter() - start
    del cache
    mx.clear_cache()
    return Measured(tokens, kv, dtype_bytes, tokens / prefill_s, decode_steps / decode_s, max(0, peak))


class Engine:
    """Serves one model. `load` runs on the engine thread too, so that thread owns the
    model's arrays from the start; `ready` is set once it has returned."""

    def __init__(self, load: Callable[[], LoadedModel], name: str, decode_batch: int = 8, prefill_step: int = 512,
                 make_cache: CacheFactory = make_prompt_cache):
        self._load = load
        self._make_cache = make_cache  # fresh caches for a request (quantized KV plugs in here)
        self.loaded: LoadedModel | None = None
        self.measured: Measured | None = None
        self.load_error: str | None = None
        self.ready = threading.Event()
        self.decode_batch = decode_batch
        self.prefill_step = prefill_step
        self.stats = EngineStats()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._active: dict[int, Request] = {}  # uid -> request, owned by the engine thread
        self._requests: dict[str, Request] = {}  # id -> request, for snapshots and cancels
        self._lock = threading.Lock()
        self._detok: dict[int, object] = {}
        self._stops: dict[int, StopMatcher] = {}
        self._sampling_failed: list[tuple[Request, str]] = []  # this step's, engine thread only
        self._thread = threading.Thread(target=self._run, name=f"engine-{name}", daemon=True)

    # --- called from any thread -------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def submit(self, request: Request) -> None:
        with self._lock:
            self._requests[request.id] = request
        self._commands.put(("submit", request))

    def cancel(self, request_id: str, error: Failed | None = None) -> None:
        """Stop a request within one step; its slot and KV cache are freed. With an `error`
        the request ends with it, so its client learns why it was stopped."""
        self._commands.put(("cancel", (request_id, error)))

    def clear_cache(self) -> None:
        """Release MLX's buffer cache, on the engine thread (it is not a memory read)."""
        self._commands.put(("clear_cache", None))

    def cancel_all(self) -> None:
        self._commands.put(("cancel_all", None))

    def stop(self, timeout: float = 5.0) -> None:
        self._commands.put(("stop", None))
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
        return sum(1 for r in self.requests() if r.state == "decode")

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # --- the engine thread ---------------------------------------------------------------

    def _new_generator(self) -> BatchGenerator:
        assert self.loaded is not None
        eos = [[t] for t in sorted(self.loaded.tokenizer.eos_token_ids)]
        return BatchGenerator(
            self.loaded.model,
            stop_tokens=eos,
            completion_batch_size=self.decode_batch,
            prefill_batch_size=self.decode_batch,
            prefill_step_size=self.prefill_step,
        )

    def _run(self) -> None:
        try:
            self.loaded = self._load()
            self.measured = warm_up(self.loaded, make_cache=self._make_cache)
        except Exception as e:
            log.exception("loading the model failed")
            self.load_error = str(e)
            return
        finally:
            self.ready.set()
        gen = self._new_generator()
        while True:
            try:
                if not self._take_commands(gen, block=not self._active):
                    break
                if self._active:
                    self._step(gen)
            except Exception as e:  # the thread must outlive any one request's failure
                log.exception("engine step failed; failing %d request(s) and starting afresh", len(self._active))
                for req in list(self._active.values()):
                    self._finish(req, Failed(f"generation failed: {e}"))
                gen = self._new_generator()
        for req in list(self._active.values()):
            self._finish(req, self._cancelled(req))
        gen.close()

    def _cancel(self, gen: BatchGenerator, req: Request, error: Failed | None = None) -> None:
        gen.remove([req.uid])
        self._finish(req, error or self._cancelled(req))

    @staticmethod
    def _cancelled(req: Request) -> Finished:
        return Finished("cancelled", len(req.prompt_ids), req.generated, req.ttft_s, req.decode_tok_s())

    def _take_commands(self, gen: BatchGenerator, block: bool) -> bool:
        """Apply waiting commands; False once asked to stop."""
        while True:
            try:
                kind, arg = self._commands.get(block=block)
            except queue.Empty:
                return True
            block = False
            if kind == "stop":
                return False
            if kind == "submit":
                self._insert(gen, arg)
            elif kind == "cancel":
                request_id, error = arg
                req = self._requests.get(request_id)
                if req is not None and req.uid in self._active:
                    self._cancel(gen, req, error)
            elif kind == "clear_cache":
                mx.clear_cache()
            elif kind == "cancel_all":
                for req in list(self._active.values()):
                    self._cancel(gen, req)

    def _insert(self, gen: BatchGenerator, req: Request) -> None:
        assert self.loaded is not None
        if not req.prompt_ids or req.max_tokens < 1:
            self._finish(req, Failed("empty prompt or max_tokens < 1"))
            return
        try:
            [uid] = gen.insert([req.prompt_ids], [req.max_tokens], caches=[self._make_cache(self.loaded.model)],
                               samplers=[self._guarded_sampler(req)])
        except Exception as e:  # not yet active, so the loop's handler would not end it: it would hang
            log.exception("request %s: starting it failed", req.id)
            self._finish(req, Failed(f"generation failed: {e}"))
            return
        req.uid, req.state = uid, "prefill"
        self._active[uid] = req
        self._detok[uid] = self.loaded.tokenizer.detokenizer
        self._stops[uid] = StopMatcher(req.stop)

    def _guarded_sampler(self, req: Request) -> Sampler:
        """The request's sampler, made to fail that request alone: a raise inside the batch's
        step would fail every request in it. Greedy requests keep the shared function object,
        so a batch of them still samples in one call."""
        sampler = make_sampler(req.sampling)
        if sampler is greedy_sampler:
            return sampler

        def sample(logprobs: mx.array) -> mx.array:
            try:
                return sampler(logprobs)
            except Exception as e:
                log.exception("request %s: sampling failed", req.id)
                self._sampling_failed.append((req, str(e)))
                return greedy_sampler(logprobs)  # a placeholder token, never emitted

        return sample

    def _step(self, gen: BatchGenerator) -> None:
        with gen.stats() as s:
            prompt_responses, generation_responses = gen.next()
        while self._sampling_failed:  # before the responses, so no placeholder token goes out
            req, why = self._sampling_failed.pop()
            if req.uid in self._active:
                self._cancel(gen, req, Failed(f"sampling failed: {why}"))
        now = time.monotonic()
        st = self.stats
        st.prefill_tokens += s.prompt_tokens
        st.prefill_seconds += s.prompt_time
        if generation_responses:
            st.decode_tokens += len(generation_responses)
            st.decode_seconds += s.decode_time
            st.recent_steps.append((now, len(generation_responses)))

        for p in prompt_responses:
            if (req := self._active.get(p.uid)) is not None:
                req.prefilled = p.progress[0]
                if p.end_of_prompt:
                    req.state = "decode"
        for r in generation_responses:
            if (req := self._active.get(r.uid)) is not None:
                self._on_token(gen, req, r.token, r.finish_reason, now)

    def _on_token(self, gen: BatchGenerator, req: Request, token: int, finish_reason: str | None, now: float) -> None:
        if req.first_token_at is None:
            req.first_token_at, req.state = now, "decode"
        detok, stops = self._detok[req.uid], self._stops[req.uid]
        if finish_reason != "stop":  # "stop" here means an EOS token, which has no text
            req.generated += 1
            detok.add_token(token)
        if finish_reason is not None:
            detok.finalize()
        text, hit = stops.feed(detok.last_segment)
        if finish_reason is not None and not hit:
            text += stops.flush()
        if text:
            self._emit(req, Chunk(text))
        if hit and finish_reason is None:
            gen.remove([req.uid])
        if hit or finish_reason is not None:
            reason = "stop" if hit else finish_reason
            self._finish(req, Finished(reason, len(req.prompt_ids), req.generated, req.ttft_s, req.decode_tok_s(now)))

    def _finish(self, req: Request, event: Event) -> None:
        if isinstance(event, Finished):
            self.stats.record(req, event)
        req.state = "done"
        self._active.pop(req.uid, None)
        self._detok.pop(req.uid, None)
        self._stops.pop(req.uid, None)
        with self._lock:
            self._requests.pop(req.id, None)
        self._emit(req, event)

    @staticmethod
    def _emit(req: Request, event: Event) -> None:
        try:
            req.emit(event)
        except Exception:  # a consumer that went away must not stop the engine
            log.exception("request %s: delivering an event failed", req.id)
