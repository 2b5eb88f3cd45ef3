"""The engine that runs a deployment (by `gmlx serve`'s model registry and the tests' live server)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from gmlx.deployment import Deployment
from gmlx.engine.drafting import check_drafter
from gmlx.engine.engine import Engine
from gmlx.engine.kv_cache import make_cache_factory
from gmlx.engine.prompt_cache import PromptCache
from gmlx.models.loader import LoadedModel, load
from gmlx.settings import Settings


def build_engine(d: Deployment, others_bytes: int = 0) -> Engine:
    """Its engine, not started, beside `others_bytes` of other models' weights (for the KV
    quantization plan, made from the header alone: gmlx.capacity.kv_quant; None when off)."""
    s = d.settings
    prompt_cache = PromptCache(s.prompt_cache_limit(d.memory), s.prompt_cache_block)
    kv_plan = d.planned_table(others_bytes)[1] if s.kv_quant().enabled else None
    engine = Engine(
        lambda: load(d.path, s.weights, max_kv_size=s.max_kv_size),
        d.model_id,
        s.decode_batch,
        s.prefill_step,
        make_cache=make_cache_factory(kv_plan),
        prompt_cache=prompt_cache,
        checkpoint_every=s.prompt_cache_checkpoint,
        load_draft=_drafter(Path(s.draft), s) if s.draft else None,
        num_draft=s.num_draft,
    )
    engine.kv_quant = kv_plan  # read by GET /v1/models and the capacity table (server.state)
    return engine


def _drafter(path: Path, settings: Settings) -> Callable[[LoadedModel], LoadedModel]:
    def load_draft(served: LoadedModel) -> LoadedModel:
        draft = load(path, settings.weights)
        check_drafter(served.tokenizer, draft.tokenizer, served.geometry, draft.geometry)
        return draft

    return load_draft
