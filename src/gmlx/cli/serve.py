"""`gmlx serve`: the OpenAI-compatible server."""

from __future__ import annotations

import logging
import os
import sys
import threading
from pathlib import Path
from typing import NoReturn

import typer
from rich.table import Table

import gmlx
from gmlx import platform
from gmlx.cli.common import (
    EXIT_BAD_MODEL,
    EXIT_FAILED,
    MODEL_ARG,
    console,
    fail,
    human_bytes,
    model_errors,
    model_path,
    print_json,
)
from gmlx.cli.completions import complete_gguf
from gmlx.settings import Settings, SettingsError, describe, resolve_settings, to_json

log = logging.getLogger("gmlx.serve")
_LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})


def serve_command(
    model: str = MODEL_ARG,
    host: str = typer.Option(None, help="Address to listen on.  [default: 127.0.0.1]", show_default=False),
    port: int = typer.Option(None, help="Port to listen on.  [default: 8080]", show_default=False),
    api_key: str = typer.Option(
        None, "--api-key", help="Require `Authorization: Bearer KEY` on every route but /health."
    ),
    cors_origins: list[str] = typer.Option(
        None,
        "--cors-origins",
        help="Browser origins allowed to call the API (repeat it, or separate with commas), or '*' for any.  "
        "[default: none, CORS off]",
        show_default=False,
    ),
    decode_batch: int = typer.Option(
        None, "--decode-batch", help="Streams decoding together.  [default: 8]", show_default=False
    ),
    queue_size: int = typer.Option(
        None, "--queue-size", help="Requests that may wait for a slot.  [default: 2 x decode batch]", show_default=False
    ),
    queue_timeout: float = typer.Option(
        None, "--queue-timeout", help="Seconds a request may wait for a slot.  [default: 120]", show_default=False
    ),
    max_body_bytes: int = typer.Option(
        None, "--max-body-bytes", help="Largest request body accepted.  [default: 4 MiB]", show_default=False
    ),
    max_connections: int = typer.Option(
        None,
        "--max-connections",
        help="Open connections accepted; more get 503.  [default: 1024, below the open-file limit]",
        show_default=False,
    ),
    header_timeout: float = typer.Option(
        None,
        "--header-timeout",
        help="Seconds a client has to send a request's headers.  [default: 10]",
        show_default=False,
    ),
    body_timeout: float = typer.Option(
        None, "--body-timeout", help="Seconds a client has to send a request's body.  [default: 30]", show_default=False
    ),
    keep_alive_timeout: float = typer.Option(
        None, "--keep-alive-timeout", help="Seconds an idle connection is kept open.  [default: 5]", show_default=False
    ),
    weights: str = typer.Option(
        None,
        help="auto, gguf (gmlx CPU kernels), native (MLX quantized) or float.  [default: auto]",
        show_default=False,
    ),
    prefill_step: int = typer.Option(
        None,
        "--prefill-step",
        help="Prompt tokens a step prefills of each prompt while nothing decodes.",
        show_default=False,
    ),
    max_tokens: int = typer.Option(
        None, "--max-tokens", help="max_tokens for a request that sets none.", show_default=False
    ),
    log_input_text: bool = typer.Option(
        None, "--log-input-text/--no-log-input-text", help="Log prompts and outputs.", show_default=False
    ),
    shutdown_timeout: float = typer.Option(
        None, "--shutdown-timeout", help="Seconds running streams get to finish on shutdown.", show_default=False
    ),
    log_level: str = typer.Option(None, "--log-level", help="debug, info, warning or error.", show_default=False),
    max_kv_size: int = typer.Option(
        None,
        "--max-kv-size",
        help="Cap the context window at this many tokens.  [default: the GGUF's trained window]",
        show_default=False,
    ),
    models_dir: str = typer.Option(
        None,
        "--models-dir",
        help="A folder of GGUF files a request may name by file name (loaded on demand).",
        show_default=False,
    ),
    models_preset: str = typer.Option(
        None,
        "--models-preset",
        help="A TOML or YAML file of models: an id, a path and per-model settings each.",
        show_default=False,
    ),
    max_resident: int = typer.Option(
        None,
        "--max-resident",
        help="Models loaded at once; the least recently used idle one makes room.  [default: as memory holds]",
        show_default=False,
    ),
    keep_alive: str = typer.Option(
        None,
        "--keep-alive",
        help="Unload a model idle this long, e.g. 10m or 300.  [default: keep it]",
        show_default=False,
    ),
    memory: str = typer.Option(
        None,
        "--memory",
        help="Memory the capacity table plans with, e.g. 64GiB.  [default: device or system memory]",
        show_default=False,
    ),
    prompt_cache_bytes: str = typer.Option(
        None,
        "--prompt-cache-bytes",
        help="Memory for reusable prompt KV, e.g. 2GiB; 0 turns the cache off.  "
        "[default: 1/16 of memory, at most 4 GiB]",
        show_default=False,
    ),
    prompt_cache_block: int = typer.Option(
        None,
        "--prompt-cache-block",
        help="Tokens per block of a prefix hit in a plain-attention model.  [default: 16]",
        show_default=False,
    ),
    prompt_cache_checkpoint: int = typer.Option(
        None,
        "--prompt-cache-checkpoint",
        help="Tokens between checkpoints of a long prefill whose cache cannot be trimmed.  [default: 1024]",
        show_default=False,
    ),
    draft: str = typer.Option(
        None,
        "--draft",
        help="A smaller GGUF with the same vocabulary that drafts tokens for speculative decoding.",
        show_default=False,
        autocompletion=complete_gguf,
    ),
    num_draft: int = typer.Option(
        None, "--num-draft", help="Tokens the drafter proposes per round.  [default: 3]", show_default=False
    ),
    kv_bits: int = typer.Option(
        None, "--kv-bits", help="Quantize the KV cache: 2, 4 or 8 bits (keys, under kvarn).", show_default=False
    ),
    kv_group_size: int = typer.Option(
        None,
        "--kv-group-size",
        help="Elements per KV quantization group: 32, 64 or 128.  [default: 64]",
        show_default=False,
    ),
    kv_scheme: str = typer.Option(
        None,
        "--kv-scheme",
        help="uniform, kvarn or auto.  [default: auto when --kv-bits is set, else off]",
        show_default=False,
    ),
    kv_value_bits: int = typer.Option(
        None, "--kv-value-bits", help="kvarn: bits of the values.  [default: 4]", show_default=False
    ),
    kv_tail_tokens: int = typer.Option(
        None, "--kv-tail-tokens", help="kvarn: newest tokens kept in float.  [default: 128]", show_default=False
    ),
    config: Path = typer.Option(
        None, "--config", help="A TOML or YAML file of settings (below flags and environment)."
    ),
    print_config: bool = typer.Option(
        False, "--print-config", help="Show each setting and where it came from, then exit."
    ),
    json_out: bool = typer.Option(False, "--json", help="With --print-config: one JSON object instead of a table."),
) -> None:
    """Serve a GGUF model over an OpenAI-compatible API with continuous batching."""
    if json_out and not print_config:  # the server logs; there is no JSON it could print instead
        fail("--json goes with --print-config", 2)
    flags = dict(
        model=model,
        host=host,
        port=port,
        api_key=api_key,
        cors_origins=cors_origins or None,
        decode_batch=decode_batch,
        queue_size=queue_size,
        queue_timeout=queue_timeout,
        max_body_bytes=max_body_bytes,
        max_connections=max_connections,
        header_timeout=header_timeout,
        body_timeout=body_timeout,
        keep_alive_timeout=keep_alive_timeout,
        weights=weights,
        prefill_step=prefill_step,
        max_tokens_default=max_tokens,
        log_input_text=log_input_text,
        shutdown_timeout=shutdown_timeout,
        log_level=log_level,
        max_kv_size=max_kv_size,
        models_dir=models_dir,
        models_preset=models_preset,
        max_resident=max_resident,
        keep_alive=keep_alive,
        memory=memory,
        prompt_cache_bytes=prompt_cache_bytes,
        prompt_cache_block=prompt_cache_block,
        prompt_cache_checkpoint=prompt_cache_checkpoint,
        draft=draft,
        num_draft=num_draft,
        kv_bits=kv_bits,
        kv_group_size=kv_group_size,
        kv_scheme=kv_scheme,
        kv_value_bits=kv_value_bits,
        kv_tail_tokens=kv_tail_tokens,
    )
    try:
        settings = resolve_settings(flags, config=config)
    except SettingsError as e:
        fail(str(e), 2)
    if print_config:
        _print_config(settings, json_out)
        return
    _exit_now(_serve(settings))


def _print_config(settings: Settings, json_out: bool) -> None:
    """What the preloaded model is served with: where a preset names its file, the preset's settings
    over the server's, each with where it came from."""
    if settings.models_preset:
        from gmlx.deployment import deployments
        from gmlx.presets import load_presets

        try:
            models = deployments(settings, model_path(settings.model), load_presets(settings.models_preset), {})
        except SettingsError as e:
            fail(str(e), 2)
        settings = next(iter(models.values())).settings
    if json_out:
        print_json(to_json(settings))
        return
    table = Table("setting", "value", "source", box=None, pad_edge=False)
    for row in describe(settings):
        table.add_row(*row)
    console.print(table)


def overridden(server: Settings, model: Settings) -> list[str]:
    """Where a preset sets the preloaded model's setting over a flag, a variable or a config file."""
    return [
        f"{model.sources[name]} sets {name} {getattr(model, name)!r} over {getattr(server, name)!r} from "
        f"{server.sources[name]}"
        for name in server.sources
        if model.sources.get(name) != server.sources[name]
        and not server.sources[name].startswith("default")
        and getattr(model, name) != getattr(server, name)
    ]


def exposure_warning(settings: Settings) -> str | None:
    """Said at start when the server listens beyond this machine with no key to keep others out."""
    if settings.host in _LOOPBACK or settings.api_key:
        return None
    return (
        f"listening on {settings.host} without an API key: anyone who can reach this address can use "
        "the model (set --api-key or GMLX_API_KEY, or --host 127.0.0.1)"
    )


def _serve(settings: Settings) -> int:
    from gmlx.capacity.memory import kv_bytes_after_prefill
    from gmlx.deployment import deployments
    from gmlx.gguf.header import read_header
    from gmlx.gguf.tokenizer import check_tokenizer, prebuild_tokenizer
    from gmlx.models.loader import architecture_for
    from gmlx.presets import load_presets
    from gmlx.server.app import create_app
    from gmlx.server.lifecycle import build_server
    from gmlx.server.system import models_dir_files

    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    path = model_path(settings.model)
    with model_errors():  # a file we cannot serve fails now, not after the server is up
        architecture_for(header := read_header(path))
        check_tokenizer(header)
    if settings.draft:  # so does a drafter that cannot draft for it (headers only, no weights)
        from gmlx.engine.drafting import check_drafter_files

        draft_path = model_path(settings.draft)
        with model_errors():
            check_drafter_files(read_header(path), read_header(draft_path))
    for warning in (platform.blas_warning(gmlx.BLAS), exposure_warning(settings)):
        if warning:
            log.warning(warning)
    try:
        presets = load_presets(settings.models_preset) if settings.models_preset else {}
        models = deployments(settings, path, presets, models_dir_files(settings.models_dir))
    except SettingsError as e:
        fail(str(e), 2)
    for note in overridden(settings, next(iter(models.values())).settings):
        log.warning("the preloaded model's %s", note)
    for d in models.values():
        if d.origin == "preset":  # each preset's file is checked now, as the positional one was
            with model_errors():
                architecture_for(d.header)
                check_tokenizer(d.header)

    app = create_app(settings, models)
    state = app.state.gmlx
    server = build_server(app)
    preloaded = state.default
    engine = preloaded.engine

    unbound = threading.Event()  # the server could not start (its port taken): no "ready" line

    def report_load() -> None:
        engine.ready.wait()
        if engine.load_error or engine.loaded is None:
            log.error("cannot serve %s: %s", path, engine.load_error)
            server.should_exit = True
            return
        while not server.started:  # it is ready once it listens too
            if unbound.wait(0.05):
                return
        m, s = engine.loaded, preloaded.settings
        log.info(
            "ready: %s (%s, %s weights, %s) loaded in %.1f s; decode batch %d, queue %d, context %d tokens",
            preloaded.model_id,
            m.geometry.architecture,
            m.mode,
            human_bytes(m.report.resident_bytes),
            m.load_seconds,
            s.decode_batch,
            s.queue_size,
            m.context_length,
        )
        table, measured = preloaded.table(), engine.measured
        if table is not None and measured is not None:
            predicted = kv_bytes_after_prefill(m.geometry, measured.tokens, table.kv)
            growth = preloaded.prefill_growth()
            log.info(
                "%s (KV at warm-up: measured %s, predicted %s; a prefill token's working memory: measured %s, "
                "predicted %s, the kernels' scratch %s; prefill %.0f tok/s, decode %.1f tok/s)",
                table.headline(),
                human_bytes(measured.kv_bytes),
                human_bytes(predicted),
                human_bytes(growth.measured if growth else None),
                human_bytes(growth.predicted if growth else None),
                human_bytes(growth.scratch if growth else None),
                measured.prefill_tok_s,
                measured.decode_tok_s,
            )

    log.info(
        "serving %s on http://%s:%d (loading the model; /health?ready=1 says when it is ready)%s",
        path.name,
        settings.host,
        settings.port,
        f"; {len(models) - 1} more model(s) load on demand" if len(models) > 1 else "",
    )
    try:  # before the port opens, so no /health poll waits on it (gmlx.gguf.tokenizer.prebuild_tokenizer)
        prebuild_tokenizer(preloaded.deployment.header)
    except Exception:  # the load meets the same error, and reports it as a load failure
        log.debug("building the tokenizer ahead failed", exc_info=True)
    state.residency.preload()
    threading.Thread(target=report_load, name="load-report", daemon=True).start()
    try:
        server.run()
    except SystemExit:  # uvicorn could not start, and said why (the port taken, most often)
        if server.started:
            raise
        unbound.set()
    for running in state.engines():  # the app's lifespan stops them too; this covers a server that never started
        running.stop()
    if unbound.is_set():
        log.error("cannot serve on %s:%d", settings.host, settings.port)
        return EXIT_FAILED
    return EXIT_BAD_MODEL if engine.load_error else 0


def _exit_now(code: int) -> NoReturn:
    """End the process once the server has drained, without the interpreter's teardown: MLX's and
    the kernels' native threads do not survive static destruction ("terminate called without an active
    exception", exit 134), and nothing of gmlx's needs it (logs and streams are flushed here)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
