"""One server under load: start to ready, decode at each width, TTFT per prompt length, memory.

Every request goes to `/v1/completions` with a raw prompt, so no server's chat template changes
the prompt length; every prompt is unique, so no prompt cache can serve it. A plan with a `schema`
sends its decode requests to `/v1/chat/completions` instead, the prompt as the user's message,
each asking for JSON of that schema (`response_format`). Token counts are the server's own `usage`
(streamed with `stream_options.include_usage`), or a recount of the returned text with the model's
tokenizer when a server sends none, never `max_tokens`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

import httpx
import psutil
from mlx_lm.tokenizer_utils import TokenizerWrapper

from bench.peers import Peer

READY_TIMEOUT_S = 300
_uid = itertools.count()


@dataclass(frozen=True)
class Plan:
    widths: tuple[int, ...]
    requests_per_client: int
    max_tokens: int
    prompt_lengths: tuple[int, ...]
    ttft_repeats: int  # a round's samples of each prompt length
    rounds: int  # every width and length measured on every peer once a round, the peers alternating
    sampling: tuple[tuple[str, float], ...] = (("temperature", 0.0),)  # the decode requests' sampling fields
    schema: dict | None = None  # the JSON schema the decode requests' output must follow (chat's response_format)


# A schema whose long required string keeps every row decoding to max_tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 60},
        "year": {"type": "integer", "minimum": 0, "maximum": 3000},
        "story": {"type": "string", "minLength": 2000},
    },
    "required": ["title", "year", "story"],
    "additionalProperties": False,
}


def endpoint(schema: dict | None) -> str:
    """Where a plan's decode requests go: chat completions where they carry a schema."""
    return "/v1/completions" if schema is None else "/v1/chat/completions"


def story_prompt() -> str:
    k = next(_uid)
    return f"Chapter {k}. The keeper of lighthouse number {k} climbed the stairs at dusk and"


def prompt_of(tokenizer: TokenizerWrapper, n_tokens: int) -> str:
    """A unique text that the model's tokenizer turns into `n_tokens` tokens, BOS included."""
    k = next(_uid)
    words = " ".join(f"note{k}x{i} about ships, tides and harbours;" for i in range(n_tokens))
    ids = tokenizer.encode(words, add_special_tokens=False)[: n_tokens - 1]
    return tokenizer.decode(ids)


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def tree_rss(proc: psutil.Process) -> int:
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def command_line(peer: Peer) -> str:
    """The peer's command as a shell line, with the environment it adds."""
    return shlex.join([f"{k}={v}" for k, v in peer.env.items()] + peer.argv)


class Server:
    """A peer's process, from Popen to ready (a health check, then one answered request)."""

    def __init__(self, peer: Peer, port: int, log_path: str):
        self.peer, self.url = peer, f"http://127.0.0.1:{port}"
        self._log = open(log_path, "w")
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(
            peer.argv,
            env={**os.environ, **peer.env},
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.ps = psutil.Process(self.proc.pid)

    def wait_ready(self) -> float:
        deadline = time.monotonic() + READY_TIMEOUT_S
        body = {"prompt": "Hello", "max_tokens": 1, "temperature": 0, **self.peer.body}
        with httpx.Client(base_url=self.url, timeout=60) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.peer.name} exited with {self.proc.returncode}; see {self._log.name}")
                try:
                    if (
                        client.get("/health").status_code == 200
                        and client.post("/v1/completions", json=body).status_code == 200
                    ):
                        return time.perf_counter() - self.started
                except httpx.TransportError:
                    pass
                time.sleep(0.2)
        raise RuntimeError(f"{self.peer.name} not ready in {READY_TIMEOUT_S} s; see {self._log.name}")

    def compute_type(self) -> str | None:
        """What the server says it runs in (gmlx: e.g. cpu/gguf-blocks-avx2+openblas); None if it has no route."""
        if self.peer.system_route is None:
            return None
        r = httpx.get(self.url + self.peer.system_route, timeout=30)
        r.raise_for_status()
        return r.json()["compute_type"]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


async def stream_once(
    client: httpx.AsyncClient,
    peer: Peer,
    tokenizer: TokenizerWrapper,
    prompt: str,
    max_tokens: int,
    sampling: tuple[tuple[str, float], ...] = (("temperature", 0.0),),
    schema: dict | None = None,
) -> dict[str, Any]:
    body = {
        "max_tokens": max_tokens,
        **dict(sampling),
        "stream": True,
        "stream_options": {"include_usage": True},
        **peer.body,
    }
    if schema is None:
        body["prompt"] = prompt
    else:
        body["messages"] = [{"role": "user", "content": f"{prompt} (Tell it as JSON.)"}]
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "story", "schema": schema}}
    start = time.perf_counter()
    first = last = None
    usage: dict[str, int] = {}
    text = []
    async with client.stream("POST", endpoint(schema), json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                usage = event["usage"]
            choice = event["choices"][0] if event.get("choices") else {}
            if piece := choice.get("text") or (choice.get("delta") or {}).get("content"):
                text.append(piece)
                last = time.perf_counter()
                first = first or last
    end = time.perf_counter()
    if "completion_tokens" in usage:
        tokens, source = usage["completion_tokens"], "usage"
    else:
        tokens, source = len(tokenizer.encode("".join(text), add_special_tokens=False)), "recount"
    decode = (tokens - 1) / (last - first) if first and last and last > first and tokens > 1 else None
    return {
        "tokens": tokens,
        "source": source,
        "start": start,
        "end": end,
        "ttft_s": (first or end) - start,
        "decode_tok_s": decode,
    }


async def run_width(server: Server, tokenizer: TokenizerWrapper, width: int, plan: Plan) -> dict[str, Any]:
    """`width` clients, each sending `requests_per_client` streams one after another."""

    async def client_loop(client: httpx.AsyncClient) -> list[dict[str, Any]]:
        return [
            await stream_once(
                client, server.peer, tokenizer, story_prompt(), plan.max_tokens, plan.sampling, plan.schema
            )
            for _ in range(plan.requests_per_client)
        ]

    peak = tree_rss(server.ps)
    # No keep-alive: reusing a connection the server has just closed fails the request for nothing.
    limits = httpx.Limits(max_connections=width + 1, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=server.url, timeout=600, limits=limits) as client:
        await stream_once(client, server.peer, tokenizer, story_prompt(), 8)  # warm-up
        start = time.perf_counter()
        task = asyncio.gather(*(client_loop(client) for _ in range(width)))
        while not task.done():
            peak = max(peak, tree_rss(server.ps))
            await asyncio.wait([task], timeout=0.25)
        wall = time.perf_counter() - start
    runs = [r for rs in task.result() for r in rs]
    tokens = sum(r["tokens"] for r in runs)
    rates = [r["decode_tok_s"] for r in runs if r["decode_tok_s"]]
    return {
        "width": width,
        "requests": len(runs),
        "completion_tokens": tokens,
        "short_streams": sum(r["tokens"] < plan.max_tokens for r in runs),
        "token_source": sorted({r["source"] for r in runs}),
        "wall_s": round(wall, 2),
        "aggregate_tok_s": round(tokens / wall, 1),
        "per_stream_decode_tok_s": round(statistics.mean(rates), 1) if rates else None,
        "ttft_mean_s": round(statistics.mean(r["ttft_s"] for r in runs), 3),
        "rss_peak_bytes": peak,
    }


def measure_ttft(server: Server, tokenizer: TokenizerWrapper, n_tokens: int, repeats: int) -> dict[str, Any]:
    """Time to a one-token answer for a unique `n_tokens` prompt, alone on the server (median)."""
    body = {"max_tokens": 1, "temperature": 0, **server.peer.body}
    times, prompt_tokens = [], []
    with httpx.Client(base_url=server.url, timeout=600) as client:
        for _ in range(repeats):
            start = time.perf_counter()
            r = client.post("/v1/completions", json={**body, "prompt": prompt_of(tokenizer, n_tokens)})
            times.append(time.perf_counter() - start)
            r.raise_for_status()
            prompt_tokens.append(r.json()["usage"]["prompt_tokens"])
    ttft = statistics.median(times)
    n = statistics.median(prompt_tokens)
    return {
        "target_tokens": n_tokens,
        "prompt_tokens": n,
        "ttft_s": round(ttft, 3),
        "prefill_tok_s": round(n / ttft, 1),
    }


def _median_row(rows: list[dict[str, Any]], keys: tuple[str, ...]) -> dict[str, Any]:
    """The first row with each of `keys` the median over the rows (None where a row has none)."""
    out = dict(rows[0])
    for k in keys:
        vals = [r[k] for r in rows if r[k] is not None]
        out[k] = round(statistics.median(vals), 3) if vals else None
    return out


def bench_peers(
    peers: dict[str, Peer], ports: dict[str, int], tokenizer: TokenizerWrapper, plan: Plan, out: str
) -> dict[str, dict[str, Any]]:
    """Every peer started in turn (each alone while it loads) and kept up; then `plan.rounds` rounds,
    each measuring every width and prompt length on one peer after another, in an order reversed
    each round. A shared machine drifts over minutes; measured alternately, the drift falls on every
    peer alike, and the ratio of a round's pair is what `ratios` takes the median of. Returns each
    peer's record (its figures the medians of its rounds, each round kept), or why it failed."""
    servers: dict[str, Server] = {}
    records: dict[str, dict[str, Any]] = {}
    rounds: dict[str, dict[str, list]] = {}

    def failed(name: str, e: Exception) -> dict[str, Any]:
        log(f"{name}: failed: {e}")
        return {"failed": f"{type(e).__name__}: {e}", "command": command_line(peers[name])}

    try:
        for name, p in peers.items():
            log(f"{name}: starting")
            try:
                server = servers[name] = Server(p, ports[name], f"{out}/{name}.log")
                ready_s = server.wait_ready()
                records[name] = {
                    "version": p.version,
                    "command": command_line(p),
                    "compute_type": server.compute_type(),
                    "ignores_eos": p.ignores_eos,
                    "notes": p.notes,
                    "ready_s": round(ready_s, 2),
                    "rss_idle_bytes": tree_rss(server.ps),
                }
                rounds[name] = {"decode": [], "ttft": []}
            except (RuntimeError, httpx.HTTPError) as e:
                records[name] = failed(name, e)
        for r in range(plan.rounds):
            order = [n for n in rounds if "failed" not in records[n]]
            order = order if r % 2 == 0 else order[::-1]
            for name in order:
                try:
                    decode = [asyncio.run(run_width(servers[name], tokenizer, w, plan)) for w in plan.widths]
                    ttft = [measure_ttft(servers[name], tokenizer, n, plan.ttft_repeats) for n in plan.prompt_lengths]
                except (RuntimeError, httpx.HTTPError) as e:  # a peer that dies mid-run is reported, not fatal
                    records[name] = failed(name, e)
                    continue
                rounds[name]["decode"].append(decode)
                rounds[name]["ttft"].append(ttft)
                log(
                    f"round {r + 1}/{plan.rounds} {name}: "
                    + " ".join(f"w{d['width']} {d['aggregate_tok_s']}" for d in decode)
                    + " tok/s; TTFT "
                    + " ".join(f"{t['target_tokens']} {t['ttft_s']} s" for t in ttft)
                )
    finally:
        for server in servers.values():
            server.stop()
    for name, got in rounds.items():
        if "failed" in records[name]:
            continue
        by_width = [list(rows) for rows in zip(*got["decode"])]
        by_length = [list(rows) for rows in zip(*got["ttft"])]
        records[name].update(
            rss_width_max_bytes=max(row["rss_peak_bytes"] for rows in by_width for row in rows),
            decode=[
                {
                    **_median_row(rows, ("aggregate_tok_s", "per_stream_decode_tok_s", "ttft_mean_s")),
                    "rss_peak_bytes": max(row["rss_peak_bytes"] for row in rows),
                    "rounds": rows,
                }
                for rows in by_width
            ],
            ttft=[{**_median_row(rows, ("ttft_s", "prefill_tok_s")), "rounds": rows} for rows in by_length],
        )
    return records
