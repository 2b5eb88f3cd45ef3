"""Regenerates tests/data/architectures/<name>.json: llama.cpp's next-token top-20 on a tiny
random-weight GGUF of each architecture in tests/reference_architectures.py, the reference
tests/test_architectures.py checks every weight mode of gmlx against.

    python -m bench.llamacpp_architectures [--only llama,qwen3] [--tokens 8]

For each architecture: writes its tiny GGUF (the same bytes every run; the JSON keeps their
sha256, so the test notices a writer that no longer makes the file the reference came from),
starts `llama-server` on it as bench/peers.py does (the cached build; llama.cpp's default
numerics: f16 KV cache, flash attention auto), and for each prompt of PROMPT_LENGTHS token ids
(ids, not text: no tokenizer between the two sides; no BOS is added to an id prompt) asks
`/completion` for `--tokens` greedy tokens with `n_probs` TOP and `post_sampling_probs: false`:
the top of the softmax of the raw logits at every step. A few seconds per architecture.

llama-server reports no probabilities for a token that leaves its text unfinished UTF-8 (a lone byte
token), and stops at an end-of-generation token: both kinds are kept off the sampler (logit_bias,
ignore_eos), which leaves the reported raw probabilities as they are; the greedy ids stored are the ones
sampled, and the test feeds those back.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import sys
import tempfile
from pathlib import Path

import httpx
import numpy as np

from bench.harness import Server
from bench.llamacpp_logits import free_port, server_flags, top_of
from bench.llamacpp_tokens import write_reference
from bench.peers import peer
from gmlx.gguf.header import read_header

TESTS = Path(__file__).parent.parent / "tests"
sys.path.insert(0, str(TESTS))  # the tiny writers live beside the tests that use them

from reference_architectures import ARCHITECTURES, EXACT  # noqa: E402
from tiny_vocab import byte_alphabet  # noqa: E402

OUT_DIR = TESTS / "data" / "architectures"
TOP = 20
CONTEXT = 256  # per slot
# Short, medium, and longer than the tiny models' 32-token sliding windows.
PROMPT_LENGTHS = (3, 17, 80)
PROMPT_SEED = 20
LOWEST_ID = 8  # above every tiny vocabulary's control tokens, below its size


def prompts(vocab_size: int) -> list[list[int]]:
    rng = np.random.default_rng(PROMPT_SEED)
    return [rng.integers(LOWEST_ID, vocab_size, n).tolist() for n in PROMPT_LENGTHS]


def vocab_size(path: Path) -> int:
    return read_header(path).tensors["token_embd.weight"].shape[-1]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def unfinished_utf8_ids(path: Path) -> list[int]:
    """Tokens that are a lone byte of a multi-byte UTF-8 character. llama-server keeps no probabilities for a
    token that leaves its text unfinished UTF-8, so the sampler is kept off them (a logit bias: the reported
    probabilities are of the raw logits all the same, and the greedy ids are what the test feeds back)."""
    h = read_header(path)
    tokens = h.get("tokenizer.ggml.tokens")
    if h.get("tokenizer.ggml.model") == "gpt2":  # byte-level BPE: each character spells one byte
        byte_of = {c: b for b, c in enumerate(byte_alphabet())}
        return [i for i, t in enumerate(tokens) if not _is_utf8(bytes(byte_of[c] for c in t))]
    return [i for i, t in enumerate(tokens) if (m := re.fullmatch(r"<0x([0-9A-F]{2})>", t)) and int(m[1], 16) >= 0x80]


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def reference_case(client: httpx.Client, ids: list[int], n_tokens: int, banned: list[int]) -> dict:
    body = {
        "prompt": ids,
        "n_predict": n_tokens,
        "temperature": 0,
        "n_probs": TOP,
        "post_sampling_probs": False,
        "cache_prompt": False,
        "return_tokens": True,
        "stream": False,
        "logit_bias": [[i, False] for i in banned],
        "ignore_eos": True,
    }  # end-of-generation tokens banned from sampling too: every case runs n_tokens
    r = client.post("/completion", json=body)
    r.raise_for_status()
    out = r.json()
    if out["tokens_evaluated"] != len(ids):
        raise RuntimeError(f"llama-server evaluated {out['tokens_evaluated']} prompt tokens, sent {len(ids)}")
    steps = [top_of(s) for s in out["completion_probabilities"]]
    if len(steps) != len(out["tokens"]) or any(len(s) != TOP for s in steps):
        raise RuntimeError(f"llama-server gave {len(out['tokens'])} tokens but {[len(s) for s in steps]} top lists")
    return {"ids": ids, "greedy": out["tokens"], "steps": steps}


def smallest_margin(cases: list[dict]) -> float:
    """The least log-probability lead of top-1 over top-2 over every step: how peaked the model is."""
    return min(float(np.log(s[0][1] / s[1][1])) for c in cases for s in c["steps"])


def reference_for(name: str, model: Path, n_tokens: int) -> dict:
    port = free_port()
    llama = peer("llama-cpp", model, port, CONTEXT)
    log = Path(tempfile.gettempdir()) / f"gmlx-llamacpp-arch-{name}.log"
    server = Server(llama, port, str(log))
    try:
        server.wait_ready()
        with httpx.Client(base_url=server.url, timeout=120) as client:
            banned = unfinished_utf8_ids(model)
            cases = [reference_case(client, ids, n_tokens, banned) for ids in prompts(vocab_size(model))]
    finally:
        server.stop()
    margin = smallest_margin(cases)
    print(f"[architectures] {name}: {len(cases)} cases, smallest top-1 margin {margin:.3f} nats", file=sys.stderr)
    return {
        "source": f"llama.cpp's llama-server {llama.version}: /completion on token ids, temperature 0, n_probs "
        f"{TOP}, post_sampling_probs false (softmax of the raw logits), no prompt cache. steps: the top "
        f"{TOP} [id, probability] before each greedy id. Regenerate: python -m bench.llamacpp_architectures",
        "architecture": name,
        "llama_cpp": llama.version,
        "server_flags": server_flags(llama.argv, model),
        "gguf_sha256": sha256(model),
        "gguf_bytes": model.stat().st_size,
        "smallest_top1_margin_nats": round(margin, 4),
        "cases": cases,
    }


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.llamacpp_architectures")
    ap.add_argument(
        "--only",
        help="comma-separated names (all of tests/reference_architectures.py's ARCHITECTURES and EXACT when omitted)",
    )
    ap.add_argument("--tokens", type=int, default=8, help="greedy tokens per prompt")
    ap.add_argument("--out-dir", type=Path, default=OUT_DIR)
    args = ap.parse_args()
    writers = {**ARCHITECTURES, **EXACT}
    names = args.only.split(",") if args.only else list(writers)
    unknown = [n for n in names if n not in writers]
    if unknown:
        ap.error(f"unknown architecture(s) {', '.join(unknown)} (known: {', '.join(writers)})")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            model = writers[name](Path(tmp) / f"tiny-{name}.gguf")
            write_reference(args.out_dir / f"{name}.json", reference_for(name, model, args.tokens))


if __name__ == "__main__":
    main()
