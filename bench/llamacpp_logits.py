"""Regenerates tests/data/gemma3_270m_llamacpp_logits.json: llama.cpp's next-token top-10 and
greedy continuations on the default model, the reference tests/test_llamacpp_parity.py checks
every weight mode against.

    python -m bench.llamacpp_logits [--model M.gguf] [--tokens 24] [--port 8390]

Starts `llama-server` as bench/peers.py does (the build cached by bench/llama_build.py, built now
if missing; llama.cpp's default numerics: flash attention `auto`, here on, f16 KV cache) on a
loopback port, and for each prompt in PROMPTS:
- asks `/tokenize` for its ids with the model's BOS (`add_special`, as llama.cpp's own
  completion does for this model), and sends those ids as the prompt, so both sides see them;
- asks `/completion` for `--tokens` greedy tokens (temperature 0, no prompt cache, stopping at
  EOS as a user's request would) with `n_probs: 10` and `post_sampling_probs: false`: the top
  10 of the softmax of the raw logits at every step, before any sampler truncates them.
About 10 seconds on 2 cores; the output is the same on every run (checked).
"""

from __future__ import annotations

import argparse
import math
import shlex
import socket
import sys
import tempfile
from pathlib import Path

import httpx

from bench.harness import Server
from bench.llamacpp_tokens import write_reference
from bench.peers import peer
from gmlx.default_model import resolve_model

REFERENCE = Path(__file__).parent.parent / "tests" / "data" / "gemma3_270m_llamacpp_logits.json"
TOP = 10
CONTEXT = 1024  # per slot; the longest prompt plus its continuation fits

PROMPTS = (
    "The capital of France is",
    "Here is a short poem about the sea:\n",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Things to pack for a camping trip:\n1. A tent\n2.",
    "Question: Why is the sky blue?\nAnswer:",
    "Translate to French: Good morning, my friend.\nFrench:",
    '{"name": "Alice", "age": 30, "languages": ["',
    # About 200 tokens of plain prose: the sliding-window layers and long-range attention at work.
    "The lighthouse stood at the end of a narrow spit of rock, a mile from the nearest house. For "
    "ninety years keepers had climbed its spiral stairs each evening to light the lamp, wind the "
    "clockwork that turned the lens, and write the weather in a leather-bound log. The last keeper, "
    "a quiet man named Thomas Hale, kept the log for twenty-two years. He recorded every storm, every "
    "ship that passed close enough to read her name, and every morning the fog came in so thick that "
    "he could not see the water below the gallery. When the light was automated, the government sent "
    "a letter thanking him for his service and a small pension. Thomas packed his books, his kettle "
    "and the last volume of the log into a wooden crate, locked the door behind him, and walked along "
    "the spit toward the village. He did not look back until he reached the harbour wall, and when he "
    "did, he saw that",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_flags(argv: list[str], model: Path) -> str:
    """The server's flags as recorded: no binary path, the model by name, no port (it varies)."""
    args = [model.name if a == str(model) else a for a in argv[1:]]
    at = args.index("--port")
    return shlex.join(args[:at] + args[at + 2 :])


def top_of(step: dict) -> list[list[float]]:
    """[[id, probability], ...] best first, from one entry of `completion_probabilities`."""
    return [[t["id"], float(f"{math.exp(t['logprob']):.7g}")] for t in step["top_logprobs"]]


def reference_case(client: httpx.Client, prompt: str, n_tokens: int) -> dict:
    r = client.post("/tokenize", json={"content": prompt, "add_special": True})
    r.raise_for_status()
    ids = r.json()["tokens"]
    body = {
        "prompt": ids,
        "n_predict": n_tokens,
        "temperature": 0,
        "n_probs": TOP,
        "post_sampling_probs": False,
        "cache_prompt": False,
        "return_tokens": True,
        "stream": False,
    }
    r = client.post("/completion", json=body)
    r.raise_for_status()
    out = r.json()
    steps = [top_of(s) for s in out["completion_probabilities"]]
    if len(steps) != len(out["tokens"]) or any(len(s) != TOP for s in steps):
        raise RuntimeError(f"llama-server gave {len(out['tokens'])} tokens but {[len(s) for s in steps]} top lists")
    stop = "eos" if out.get("stopped_eos") else "limit"
    return {"prompt": prompt, "ids": ids, "top": steps[0], "greedy": out["tokens"], "stop": stop, "steps": steps}


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.llamacpp_logits")
    ap.add_argument("--model", help="GGUF file (the default model when omitted)")
    ap.add_argument("--tokens", type=int, default=24, help="greedy tokens per prompt")
    ap.add_argument("--port", type=int, default=0, help="loopback port (a free one when 0)")
    ap.add_argument("--out", type=Path, default=REFERENCE)
    args = ap.parse_args()
    model = resolve_model(args.model)
    port = args.port or free_port()
    llama = peer("llama-cpp", model, port, CONTEXT)
    log = Path(tempfile.gettempdir()) / "gmlx-llamacpp-logits.log"
    server = Server(llama, port, str(log))
    try:
        server.wait_ready()
        with httpx.Client(base_url=server.url, timeout=300) as client:
            cases = [reference_case(client, p, args.tokens) for p in PROMPTS]
    finally:
        server.stop()
    reference = {
        "source": f"llama.cpp's llama-server {llama.version}: /tokenize with add_special, then /completion "
        f"on those ids, temperature 0, n_probs {TOP}, post_sampling_probs false (softmax of the "
        "raw logits), no prompt cache. top: the next token's top 10 [id, probability]; greedy: "
        "the greedy ids; steps: the top 10 before each greedy id (steps[0] == top). "
        "Regenerate: python -m bench.llamacpp_logits",
        "llama_cpp": llama.version,
        "server_flags": server_flags(llama.argv, model),
        "model": model.name,
        "model_bytes": model.stat().st_size,
        "cases": cases,
    }
    write_reference(args.out, reference)
    print(f"[logits] wrote {len(cases)} cases to {args.out} (llama.cpp {llama.version})", file=sys.stderr)


if __name__ == "__main__":
    main()
