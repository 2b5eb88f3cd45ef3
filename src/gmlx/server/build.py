"""The engine a server runs, assembled from its settings (by `gmlx serve` and by the tests' live server)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from gmlx import platform
from gmlx.capacity.kv_quant import server_plan
from gmlx.engine.drafting import check_drafter
from gmlx.engine.engine import Engine
from gmlx.engine.kv_cache import make_cache_factory
from gmlx.engine.prompt_cache import PromptCache
from gmlx.gguf.header import read_header
from gmlx.models.loader import LoadedModel, load
from gmlx.server.settings import Settings


def build_engine(settings: Settings, path: Path) -> Engine:
    memory = settings.memory or platform.total_memory_bytes()
    prompt_cache = PromptCache(settings.prompt_cache_limit(memory), settings.prompt_cache_block)
    # KV quantization (gmlx.capacity.kv_quant), planned from the header alone; None when off.
    kv_plan = None
    if settings.kv_quant().enabled:
        kv_plan = server_plan(
            settings.kv_quant(),
            read_header(path).geometry,
            memory=memory,
            weight_bytes=path.stat().st_size,
            reserve_fraction=settings.reserve_fraction,
            reserve_floor=settings.reserve_floor,
            prompt_cache_bytes=settings.prompt_cache_limit(memory),
            streams=settings.decode_batch,
            context_length=settings.max_kv_size,
        )
    engine = Engine(
        lambda: load(path, settings.weights, max_kv_size=settings.max_kv_size),
        path.stem,
        settings.decode_batch,
        settings.prefill_step,
        make_cache=make_cache_factory(kv_plan),
        prompt_cache=prompt_cache,
        checkpoint_every=settings.prompt_cache_checkpoint,
        load_draft=_drafter(Path(settings.draft), settings) if settings.draft else None,
        num_draft=settings.num_draft,
    )
    engine.kv_quant = kv_plan  # read by GET /v1/models and the capacity table (server.state)
    return engine


def _drafter(path: Path, settings: Settings) -> Callable[[LoadedModel], LoadedModel]:
    def load_draft(served: LoadedModel) -> LoadedModel:
        draft = load(path, settings.weights)
        check_drafter(served.tokenizer, draft.tokenizer, served.geometry, draft.geometry)
        return draft

    return load_draft
