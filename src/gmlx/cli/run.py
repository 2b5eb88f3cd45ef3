"""`gmlx run`: load a model, stream one generation, end with one line of figures."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from gmlx.cli.common import (
    JSON_OPT,
    MODEL_ARG,
    err_console,
    fail,
    human_bytes,
    model_errors,
    model_path,
    print_json,
    warn_if_slow_blas,
)

LOAD_STEPS = ("header", "weights", "model", "tokenizer")


@contextmanager
def load_progress() -> Iterator:
    """A progress bar over the load steps on a terminal; nothing when stderr is piped."""
    if not err_console.is_terminal:
        yield None
        return
    with Progress(
        TextColumn("loading {task.fields[step]:<9}"),
        BarColumn(),
        TimeElapsedColumn(),
        console=err_console,
        transient=True,
    ) as bar:
        task = bar.add_task("load", total=len(LOAD_STEPS), step="")

        def step(name: str) -> None:
            bar.update(task, completed=LOAD_STEPS.index(name), step=name)

        yield step


def run_command(
    model: str = MODEL_ARG,
    prompt: str = typer.Option(None, "--prompt", "-p", help="The prompt; read from stdin when omitted."),
    max_tokens: int = typer.Option(256, "--max-tokens", "-n", min=1, help="Most tokens to generate."),
    chat: bool = typer.Option(False, "--chat", help="Wrap the prompt in the model's chat template."),
    temp: float = typer.Option(0.0, "--temp", min=0.0, help="Sampling temperature; 0 is greedy."),
    top_p: float = typer.Option(1.0, "--top-p", min=0.0, max=1.0),
    top_k: int = typer.Option(0, "--top-k", min=0),
    min_p: float = typer.Option(0.0, "--min-p", min=0.0, max=1.0),
    seed: int = typer.Option(None, "--seed", help="Seed for sampling, so a run repeats."),
    weights: str = typer.Option(
        "auto", help="auto, gguf (the file's blocks, gmlx kernels), native (MLX quantized) or float (dequantized)."
    ),
    json_out: bool = JSON_OPT,
) -> None:
    """Generate from a model, streaming the text, then print speed and memory figures."""
    if weights not in ("auto", "native", "float", "gguf"):
        fail(f"--weights must be auto, native, float or gguf, not {weights!r}", 2)
    if prompt is None:
        if sys.stdin.isatty():
            fail("no prompt: pass --prompt TEXT or pipe it on stdin", 2)
        prompt = sys.stdin.read()
    path = model_path(model)
    warn_if_slow_blas()

    import mlx.core as mx
    from mlx_lm import stream_generate

    from gmlx.engine.sampling import SamplingParams, make_sampler
    from gmlx.gguf.detokenizer import continuation_detokenizer
    from gmlx.kernels import fast as kernels_fast
    from gmlx.models.loader import load

    kernels_fast.install()  # as a server's engine does
    with model_errors(), load_progress() as step:
        loaded = load(path, weights, progress=step)  # type: ignore[arg-type]
    tokenizer = loaded.tokenizer
    if chat:
        prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    else:
        prompt_ids = tokenizer.encode(prompt)
    if len(prompt_ids) >= loaded.context_length:
        fail(f"the prompt has {len(prompt_ids)} tokens; the context holds {loaded.context_length}")
    room = loaded.context_length - len(prompt_ids)
    if max_tokens > room:  # the server cuts its default so too: past the window the model has no positions
        err_console.print(f"note: --max-tokens {max_tokens} cut to {room}, what the context window leaves")
        max_tokens = room
    sampler = make_sampler(SamplingParams(temp, top_p, top_k, min_p, seed))

    # The text comes from our own detokenizer: stream_generate's drops the first token's leading space.
    detok = continuation_detokenizer(tokenizer, prompt_ids)
    text, last = [], None
    for last in stream_generate(loaded.model, tokenizer, prompt_ids, max_tokens=max_tokens, sampler=sampler):
        if last.finish_reason != "stop":  # each response brings a new token, but for the EOS that ends it
            detok.add_token(last.token)
        if last.finish_reason is not None:
            detok.finalize()
        text.append(piece := detok.last_segment)
        if not json_out:
            sys.stdout.write(piece)
            sys.stdout.flush()
    assert last is not None, "stream_generate yields at least one response"
    figures = {
        "prompt_tokens": last.prompt_tokens,
        "generated_tokens": last.generation_tokens,
        "prefill_tok_s": round(last.prompt_tps, 1),
        "decode_tok_s": round(last.generation_tps, 1),
        "load_s": round(loaded.load_seconds, 3),
        "peak_memory_bytes": int(mx.get_peak_memory()),
        "finish_reason": last.finish_reason,
        "weights": {
            "mode": loaded.mode,
            "resident_bytes": loaded.report.resident_bytes,
            "detail": loaded.report.describe(),
        },
    }
    if json_out:
        print_json({"model": str(path), "text": "".join(text), **figures})
        return
    sys.stdout.write("\n")
    err_console.print(
        f"prompt {figures['prompt_tokens']} tok, generated {figures['generated_tokens']} tok | "
        f"prefill {figures['prefill_tok_s']} tok/s, decode {figures['decode_tok_s']} tok/s | "
        f"load {figures['load_s']} s | peak {human_bytes(figures['peak_memory_bytes'])} | "
        f"weights {loaded.mode} ({human_bytes(loaded.report.resident_bytes)})",
        highlight=False,
        soft_wrap=True,  # one line, also when piped
    )
    if lossy := loaded.report.lossy():
        err_console.print(
            f"note: not exact in {loaded.mode} weights: {'; '.join(lossy)}", highlight=False, soft_wrap=True
        )
