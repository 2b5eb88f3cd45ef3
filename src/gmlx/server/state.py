"""What the routes share: settings, the engine, the admission gate, and the capacity table."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gmlx import platform
from gmlx.capacity.memory import KVFormat
from gmlx.capacity.table import CapacityTable, attention_in_tiles, capacity_table, governor_terms
from gmlx.engine.engine import Engine
from gmlx.gguf.vocab import token_bytes
from gmlx.kernels import fast as kernels_fast
from gmlx.server import openai_api
from gmlx.server.admission import AdmissionGate
from gmlx.server.connections import ConnectionStats
from gmlx.server.errors import APIError
from gmlx.server.prometheus import Histograms
from gmlx.server.settings import Settings

if TYPE_CHECKING:
    from gmlx.server.memory_governor import Governor

LOADING_RETRY_AFTER_S = 5


@dataclass(frozen=True)
class QueuedRow:
    """A request waiting at the gate, as the metrics snapshot lists it."""

    id: str
    prompt_tokens: int
    max_tokens: int
    arrived_at: float  # when the server received the request: its elapsed and TTFT count from here
    since: float = field(default_factory=time.monotonic)  # in the queue since

    def queued_s(self, now: float) -> float:
        return now - self.since


@dataclass
class ServerState:
    settings: Settings
    engine: Engine
    model_id: str
    gate: AdmissionGate = field(init=False)
    connections: ConnectionStats = field(init=False)  # its cap set to what the file limit allows at start
    started_at: float = field(default_factory=time.time)
    # transformers' fast tokenizers may reconfigure the shared Rust object per call
    # ("Already borrowed" when two threads meet), so encoding takes turns.
    _tokenizer_lock: threading.Lock = field(default_factory=threading.Lock)
    _table: CapacityTable | None = None
    _token_bytes: list[bytes] | None = None
    queued: dict[str, QueuedRow] = field(default_factory=dict)  # id -> row, in arrival order
    governor: Governor | None = None  # set by create_app; with GMLX_GOVERNOR=0 it runs disabled and says so
    histograms: Histograms = field(default_factory=lambda: Histograms())
    # The memory governor's band; None until a governor runs (a test may set it meanwhile).
    band: str | None = None

    def __post_init__(self) -> None:
        s, stats = self.settings, self.engine.stats
        rate = lambda: stats.decode_tok_s_recent() or stats.decode_tok_s_lifetime()  # noqa: E731
        self.gate = AdmissionGate(
            s.decode_batch, s.queue_size, s.queue_timeout, lambda: (stats.mean_generated(), rate())
        )
        self.connections = ConnectionStats(s.max_connections)

    @property
    def ready(self) -> bool:
        return self.engine.ready.is_set() and self.engine.loaded is not None

    def require_ready(self) -> None:
        if not self.ready:
            raise APIError(503, "the model is still loading", "model_loading", retry_after=LOADING_RETRY_AFTER_S)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_id:
            raise APIError(
                404, f"model {model!r} is not served here (this server serves {self.model_id!r})", "model_not_found"
            )

    def weight_bytes(self) -> int:
        """Resident weights: the served model's, and its drafter's when one drafts for it."""
        loaded, draft = self.engine.loaded, self.engine.draft
        assert loaded is not None
        return loaded.report.resident_bytes + (draft.report.resident_bytes if draft is not None else 0)

    def table(self) -> CapacityTable | None:
        """The capacity table, built once the model is loaded (None before)."""
        loaded, measured = self.engine.loaded, self.engine.measured
        if self._table is None and loaded is not None and measured is not None:
            s = self.settings
            memory = s.memory or platform.total_memory_bytes()
            self._table = capacity_table(
                loaded.geometry,
                weight_bytes=self.weight_bytes(),
                decode_batch=s.decode_batch,
                prefill_step=s.prefill_step,
                kv=self.kv_format(measured.kv_dtype_bytes),
                memory=memory,
                reserve_fraction=s.reserve_fraction,
                reserve_floor=s.reserve_floor,
                context_length=loaded.context_length,
                prompt_cache_bytes=s.prompt_cache_limit(memory),
                tiled_attention=attention_in_tiles(kernels_fast.installed(), getattr(self.engine, "kv_quant", None)),
                governor=governor_terms(s, measured.host_bytes, platform.backend() != "cuda"),
            )
        return self._table

    def kv_format(self, float_bytes: int) -> KVFormat:
        """The KV cache's format: the engine's quantization plan, or float."""
        plan = getattr(self.engine, "kv_quant", None)
        return plan.kv_format(float_bytes) if plan is not None else KVFormat(float_bytes=float_bytes)

    def tokenize_with_anchor(self, p: openai_api.GenerationParams) -> tuple[list[int], int]:
        """The prompt's ids, and where its shared system prompt ends (for the prompt cache)."""
        ids = self.tokenize(p)
        if not p.chat or self.engine.prompt_cache is None:
            return ids, 0
        with self._tokenizer_lock:
            return ids, openai_api.system_prefix_tokens(
                self.engine.loaded.tokenizer,
                p.messages,
                ids,  # type: ignore[union-attr]
                p.tools,
            )

    def token_bytes(self) -> list[bytes]:
        """Every token's bytes, by id (for logprobs), read from the vocabulary once."""
        if self._token_bytes is None:
            assert self.engine.loaded is not None
            self._token_bytes = token_bytes(self.engine.loaded.header)
        return self._token_bytes

    def tokenize(self, p: openai_api.GenerationParams) -> list[int]:
        loaded = self.engine.loaded
        assert loaded is not None
        with self._tokenizer_lock:
            return openai_api.prompt_token_ids(loaded.tokenizer, p, loaded.geometry.vocab_size)
