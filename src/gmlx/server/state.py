"""What the routes share: the server's settings and figures (`ServerState`), and for each model it
may serve, its deployment, engine, admission gate and capacity table (`ModelState`)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from gmlx import platform
from gmlx.capacity.memory import KVFormat
from gmlx.capacity.table import (
    CapacityTable,
    PrefillGrowth,
    attention_in_tiles,
    capacity_table,
    governor_terms,
    prefill_growth,
)
from gmlx.deployment import Deployment
from gmlx.engine.engine import Engine, EngineStats
from gmlx.engine.prompt_cache import PromptCacheStats
from gmlx.gguf.vocab import token_bytes
from gmlx.kernels import fast as kernels_fast
from gmlx.server import openai_api
from gmlx.server.admission import AdmissionGate
from gmlx.server.connections import ConnectionStats
from gmlx.server.errors import APIError, bad_request
from gmlx.server.prometheus import Histograms
from gmlx.settings import Settings

if TYPE_CHECKING:
    from gmlx.server.memory_governor import Governor
    from gmlx.server.residency import Residency

LOADING_RETRY_AFTER_S = 5
Status = Literal["unloaded", "loading", "loaded"]


@dataclass(frozen=True)
class QueuedRow:
    """A request waiting at the gate, as the metrics snapshot lists it."""

    id: str
    prompt_tokens: int | None  # None while its model loads: its tokenizer comes with it
    max_tokens: int | None
    arrived_at: float  # when the server received the request: its elapsed and TTFT count from here
    since: float = field(default_factory=time.monotonic)  # in the queue since

    def queued_s(self, now: float) -> float:
        return now - self.since


@dataclass
class EmbeddingRow:
    """An embeddings request from its arrival to its answer, as the metrics snapshot lists it: queued
    at the gate, then `prefill` while the engine runs its inputs (an embedding is a prefill that
    keeps no cache and decodes nothing)."""

    id: str
    inputs: int
    arrived_at: float
    tokens: int | None = None  # all its inputs' tokens; None until tokenized (its model loading)
    longest: int | None = None  # its longest input: the one cache the engine holds at once
    started_at: float | None = None  # when the engine was handed its inputs

    def tokenized(self, ids: list[list[int]]) -> list[list[int]]:
        self.tokens, self.longest = sum(len(x) for x in ids), max(len(x) for x in ids)
        return ids

    @property
    def state(self) -> Literal["queued", "prefill"]:
        return "queued" if self.started_at is None else "prefill"

    @property
    def cache_tokens(self) -> int | None:
        """The depth of the cache it holds now: its longest input's while it runs, else none."""
        return self.longest if self.started_at is not None else None


@dataclass
class EmbeddingStats:
    """Embeddings requests since start (a model's outlive its unloading, as its EngineStats do)."""

    requests: int = 0  # answered
    failed: int = 0  # the engine raised
    input_tokens: int = 0  # over the answered ones


@dataclass
class ModelState:
    """One model the server may serve: resident while it has an engine. Its gate and queued rows
    outlive its engine, so requests that arrive while it loads wait in its own queue."""

    deployment: Deployment
    histograms: Histograms
    engine: Engine | None = None
    gate: AdmissionGate = field(init=False)
    queued: dict[str, QueuedRow] = field(default_factory=dict)  # id -> row, in arrival order
    last_used: float = field(default_factory=time.time)  # unix time a request last named it
    loaded_at: float | None = None  # unix time its engine became ready
    load_error: str | None = None  # why its last load failed, until the next one
    failed_file: tuple[int, int] | None = None  # the file's (mtime, size) then: a changed file is tried again
    others_bytes: int = 0  # the other models' weights beside it when it loaded: its table's
    stats: EngineStats = field(default_factory=EngineStats)  # every engine it has had records here
    prompt_cache_stats: PromptCacheStats = field(default_factory=PromptCacheStats)  # so do their prompt caches
    embeddings: dict[str, EmbeddingRow] = field(default_factory=dict)  # id -> row, queued or running
    embedding_stats: EmbeddingStats = field(default_factory=EmbeddingStats)
    pins: int = 0  # requests readying for its gate (Residency.pinned): it stays resident meanwhile
    # transformers' fast tokenizers may reconfigure the shared Rust object per call
    # ("Already borrowed" when two threads meet), so encoding takes turns.
    tokenizer_lock: threading.Lock = field(default_factory=threading.Lock)
    _table: CapacityTable | None = None
    _table_json: dict | None = None
    _token_bytes: list[bytes] | None = None

    def __post_init__(self) -> None:
        s = self.settings
        self.gate = AdmissionGate(s.decode_batch, s.queue_size, s.queue_timeout, self.drain_rate)

    def check_choices(self, n: int) -> None:
        """A 400 for more choices than its decode batch: they decode side by side, each a row."""
        if n > self.gate.width:
            raise bad_request(f"'n' must be at most {self.gate.width}, the decode batch of {self.model_id!r}", "n")

    def drain_rate(self) -> tuple[float | None, float | None]:
        """(mean generated tokens per request, aggregate decode tok/s) for its queue's wait, or Nones."""
        if self.engine is None:
            return None, None
        stats = self.engine.stats
        return stats.mean_generated(), stats.decode_tok_s_recent() or stats.decode_tok_s_lifetime()

    @property
    def model_id(self) -> str:
        return self.deployment.model_id

    @property
    def settings(self) -> Settings:
        return self.deployment.settings

    @property
    def status(self) -> Status:
        if self.engine is None:
            return "unloaded"
        return "loaded" if self.ready else "loading"

    @property
    def ready(self) -> bool:
        return self.engine is not None and self.engine.ready.is_set() and self.engine.loaded is not None

    @property
    def idle(self) -> bool:
        """Nothing in flight, queued, holding a slot or readying for one: it may be unloaded unnoticed."""
        engine = self.engine
        busy = self.pins or self.gate.running or self.gate.waiting or (engine is not None and engine.in_flight)
        return not busy

    def busy_at(self) -> float:
        """Unix time it was last busy: a request named it, its load finished, or a request ended;
        what its idle time (keep-alive, the least recently used first) counts from."""
        return max(self.last_used, self.loaded_at or 0.0, self.gate.last_release)

    def weight_bytes(self) -> int:
        """Resident weights, its drafter's included: measured once loaded, planned before."""
        engine = self.engine
        if engine is None or engine.loaded is None:
            return self.deployment.planned_weight_bytes
        draft = engine.draft
        return engine.loaded.report.resident_bytes + (draft.report.resident_bytes if draft is not None else 0)

    def table(self) -> CapacityTable | None:
        """The capacity table, built once the model is loaded (None before)."""
        engine = self.engine
        if engine is None:
            return None
        loaded, measured = engine.loaded, engine.measured
        if self._table is None and loaded is not None and measured is not None:
            s, d = self.settings, self.deployment
            self._table = capacity_table(
                loaded.geometry,
                weight_bytes=self.weight_bytes(),
                decode_batch=s.decode_batch,
                prefill_step=s.prefill_step,
                kv=self.kv_format(measured.kv_dtype_bytes),
                memory=d.memory,
                reserve_fraction=s.reserve_fraction,
                reserve_floor=s.reserve_floor,
                context_length=loaded.context_length,
                prompt_cache_bytes=s.prompt_cache_limit(d.memory),
                tiled_attention=self._tiled_attention(),
                governor=governor_terms(s, measured.host_bytes, platform.backend() != "cuda"),
                others_bytes=self.others_bytes,
                growth=self.prefill_growth(),
            )
        return self._table

    def prefill_growth(self) -> PrefillGrowth | None:
        """What a prefill chunk's token adds to its memory, predicted and measured at the warm-up
        (None before it)."""
        engine = self.engine
        if engine is None or engine.loaded is None or (m := engine.measured) is None:
            return None
        return prefill_growth(
            engine.loaded.geometry,
            self.kv_format(m.kv_dtype_bytes),
            self._tiled_attention(),
            m.tokens,
            m.prefill_peak_bytes,
            m.doubled_prefill_peak_bytes,
            m.prefill_scratch_bytes,
        )

    def _tiled_attention(self) -> bool:
        return attention_in_tiles(kernels_fast.installed(), getattr(self.engine, "kv_quant", None))

    def table_json(self) -> dict | None:
        """The table as JSON, made once per table (its binary searches cost more than a snapshot's
        rest); a copy, so a caller may add to it."""
        table = self.table()
        if table is None:
            return None
        if self._table_json is None:
            self._table_json = table.to_json()
        return dict(self._table_json)

    def kv_format(self, float_bytes: int) -> KVFormat:
        """The KV cache's format: the engine's quantization plan, or float."""
        plan = getattr(self.engine, "kv_quant", None)
        return plan.kv_format(float_bytes) if plan is not None else KVFormat(float_bytes=float_bytes)

    def attach(self, engine: Engine, others_bytes: int) -> None:
        """A new engine for it (loading), beside `others_bytes` of the other models' weights."""
        self.engine, self.others_bytes, self.load_error, self.loaded_at = engine, others_bytes, None, None
        self._table = self._table_json = self._token_bytes = None
        engine.stats = self.stats  # its counts go on across loads (Prometheus counters never fall)
        if engine.prompt_cache is not None:  # its entries start afresh, its counts go on
            engine.prompt_cache.stats = self.prompt_cache_stats
        engine.on_token_gap = lambda seconds: self.histograms.observe_gap(self.model_id, seconds)

    def detach(self) -> Engine | None:
        """Drop its engine (unloaded, or failed to load): nothing here keeps its arrays alive."""
        engine, self.engine = self.engine, None
        self._table = self._table_json = self._token_bytes = None
        return engine

    def tokenize_with_anchor(self, p: openai_api.GenerationParams) -> tuple[list[int], int]:
        """The prompt's ids, and where its shared system prompt ends (for the prompt cache)."""
        ids = self.tokenize(p)
        engine = self._engine()
        if not p.chat or engine.prompt_cache is None:
            return ids, 0
        with self.tokenizer_lock:
            return ids, openai_api.system_prefix_tokens(engine.loaded.tokenizer, p.messages, ids, p.tools)  # type: ignore[union-attr]

    def token_bytes(self) -> list[bytes]:
        """Every token's bytes, by id (for logprobs), read from the vocabulary once per load."""
        if self._token_bytes is None:
            loaded = self._engine().loaded
            assert loaded is not None
            self._token_bytes = token_bytes(loaded.header)
        return self._token_bytes

    def tokenize(self, p: openai_api.GenerationParams) -> list[int]:
        loaded = self._engine().loaded
        assert loaded is not None
        with self.tokenizer_lock:
            return openai_api.prompt_token_ids(loaded.tokenizer, p, loaded.geometry.vocab_size)

    def _engine(self) -> Engine:
        """Its engine while it serves; a request that holds a slot keeps it from being unloaded."""
        engine = self.engine
        assert engine is not None, f"{self.model_id} is not loaded"
        return engine


@dataclass
class ServerState:
    """The server: its own settings (a model's come from its deployment), its models by id, the
    preloaded one first (a request that names no model gets it), and what they all share."""

    settings: Settings
    models: dict[str, ModelState]
    connections: ConnectionStats = field(init=False)  # its cap set to what the file limit allows at start
    started_at: float = field(default_factory=time.time)
    histograms: Histograms = field(default_factory=lambda: Histograms())
    governor: Governor | None = None  # set by create_app; with GMLX_GOVERNOR=0 it runs disabled and says so
    residency: Residency | None = None  # set by create_app: loads and unloads models
    # The memory governor's band; None until a governor runs (a test may set it meanwhile).
    band: str | None = None

    def __post_init__(self) -> None:
        self.connections = ConnectionStats(self.settings.max_connections)

    @property
    def default(self) -> ModelState:
        """The preloaded model: the positional one of `gmlx serve`."""
        return next(iter(self.models.values()))

    @property
    def model_id(self) -> str:
        return self.default.model_id

    def resident(self) -> list[ModelState]:
        return [m for m in self.models.values() if m.engine is not None]

    def engines(self) -> list[Engine]:
        return [m.engine for m in self.resident()]  # type: ignore[misc]

    def budget_table(self) -> CapacityTable | None:
        """The preloaded model's table, else any resident one's: the memory budget (total, reserve)
        is the server's, whichever model's table states it. None while none is loaded."""
        return next((t for m in [self.default, *self.resident()] if (t := m.table()) is not None), None)

    def find(self, model: str | None) -> ModelState:
        """The model a request names (None: the preloaded one); 404 `model_not_found` otherwise."""
        if model is None:
            return self.default
        found = self.models.get(model) or (self.residency.discover(model) if self.residency else None)
        if found is None:
            raise APIError(
                404,
                f"model {model!r} is not served here (GET /v1/models lists those that are)",
                "model_not_found",
                param="model",
            )
        return found

    @property
    def ready(self) -> bool:
        """Some model can take work: one is loaded, or every one was unloaded (idle past its keep-alive)
        and the first request loads its model again."""
        return any(m.ready for m in self.models.values()) or self.cold

    @property
    def cold(self) -> bool:
        """No model resident or loading, and the preloaded one did not fail to load."""
        return all(m.engine is None for m in self.models.values()) and self.default.load_error is None

    @property
    def closed(self) -> bool:
        return self.default.gate.closed
