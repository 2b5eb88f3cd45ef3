"""The `gguf` weight mode (gmlx.kernels) against float32 + OpenBLAS and llama.cpp, in one run.

    python -m bench.bench_kernels [--model M.gguf] [--steps 32] [--rounds 3] [--modes gguf,float] [--no-llama]
    python -m bench.bench_kernels --matmuls [--isas avx2,avx512] [--rounds 5]

Measures, on one model file and the same cores:
- decode tok/s at batch 1, 4 and 8 (aggregate): gmlx modes step the mlx_lm model directly
  (B streams, one token each per step, greedy, each step's graph built while the previous
  one computes), after a 16-token prompt; llama.cpp runs
  `llama-server -np 8` with B concurrent requests and the sum of each stream's own
  generation rate (its `timings.predicted_per_second`).
- prefill tok/s at 512 tokens: gmlx as mlx_lm prefills (511 tokens evaluating only the KV
  cache, then the last token's logits); llama.cpp's `timings.prompt_per_second`.
- the machine's memory read bandwidth (numpy reductions over 1 GiB, one thread per kernel
  thread, best of 5), and each decode figure as a share of the limit it sets: a step reads every
  weight once, so a mode's resident bytes x steps per second over that bandwidth;
- for the gguf mode, a profile of one batch-1 decode step: the linear layers' matmuls,
  the LM head, and the rest (attention, norms, graph overhead).

A mode may name the kernels' ISA, `gguf:avx2` (GMLX_KERNELS_ISA for that process), and the
activation codes' bits, `gguf@8` or `gguf:avx2@16` (GMLX_KERNELS_ACT_BITS), to set them side by
side: `--modes gguf:avx2,gguf:avx512 --no-llama`, `--modes gguf@16,gguf@8`; each later mode is
then also given as a ratio to the first. Each gmlx mode runs in its own process, all engines stay
loaded, and the rounds interleave
them (each figure: the best of the rounds), so a shared machine's load falls on all alike.
Writes bench/results/kernels-<model>.json.

--matmuls instead times each distinct matmul of the model (GGML type, N x K, and the tied LM
head) alone at batch 1, 4 and 8, one ISA against another in the same process (rounds
interleave them; best of rounds): ms per matmul and Gweights/s per kernel thread
(GMLX_KERNELS_THREADS, else every core), and the ratio of each ISA to the first. A weight of a
type gmlx packs (gmlx.kernels.PACKABLE) is timed in the file's layout and packed (`Q8_0_R16` and
so on, for the ISAs whose kernels take it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

RESULTS = Path(__file__).parent / "results"
BATCHES = (1, 4, 8)
PREFILL = 512
PROMPT = 16


def kernel_threads() -> int:
    """The kernels' threads: GMLX_KERNELS_THREADS, else one for each CPU this process may run on."""
    from gmlx.platform import usable_cpus

    return int(os.environ.get("GMLX_KERNELS_THREADS", 0)) or usable_cpus()


def step_decode(model, b: int, steps: int, rng: np.random.Generator) -> float:
    """B greedy streams stepped directly, one token each a step, after a PROMPT-token prompt, as
    mlx_lm's generate_step and the engine run: the next step's graph is built while the current
    one computes. Returns tok/s. (mlx is imported here: the parent process never imports it.)"""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from gmlx.engine.sampling import greedy

    def step(y, cache):  # the engine's greedy sampler (gmlx's argmax node where the kernels run)
        return greedy(model(y, cache=cache)[:, -1])[:, None]

    cache = make_prompt_cache(model)
    y = step(mx.array(rng.integers(1000, 20000, (b, PROMPT))), cache)
    for _ in range(2):
        y = step(y, cache)
        mx.eval(y)
    t = time.perf_counter()
    for _ in range(steps):
        nxt = step(y, cache)
        mx.async_eval(nxt)
        mx.eval(y)
        y = nxt
    mx.eval(y)
    return b * steps / (time.perf_counter() - t)


def _worker(model: str, mode: str) -> None:
    """A loaded model answering commands on stdin, one JSON line each on stdout:
    `decode B STEPS`, `prefill`, `profile STEPS`; the first line out is the load report."""
    import numpy as np

    import gmlx  # noqa: F401  (BLAS bring-up before mlx)
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from gmlx.kernels import fast as kernels_fast
    from gmlx.models.loader import load

    kernels_fast.install()  # as a server's engine does
    t0 = time.perf_counter()
    m = load(model, mode.split("@")[0].split(":")[0])  # type: ignore[arg-type]
    import gmlx.kernels as gk

    print(
        json.dumps(
            {
                "mode": m.mode,
                "isa": gk.isa(),
                "act_bits": os.environ.get("GMLX_KERNELS_ACT_BITS", "default"),
                "load_s": round(time.perf_counter() - t0, 2),
                "resident_bytes": m.report.resident_bytes,
                "weights": m.report.describe(),
            }
        ),
        flush=True,
    )
    model_ = m.model
    rng = np.random.default_rng(0)

    def decode(b: int, steps: int) -> float:
        return step_decode(model_, b, steps, rng)

    def prefill() -> float:  # as mlx_lm prefills: the prompt fills the cache, logits of the last token only
        cache = make_prompt_cache(model_)
        toks = mx.array(rng.integers(1000, 20000, (1, PREFILL)))
        t = time.perf_counter()
        model_(toks[:, :-1], cache=cache)
        mx.eval([c.state for c in cache])
        mx.eval(model_(toks[:, -1:], cache=cache))
        return PREFILL / (time.perf_counter() - t)

    prefill()  # warm-up, untimed: one-time buffers (llama-server allocates its own at start, and is sent a warm-up)
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "decode":
            out = {"tok_s": decode(int(cmd[1]), int(cmd[2]))}
        elif cmd[0] == "prefill":
            out = {"tok_s": prefill()}
        elif cmd[0] == "profile":
            out = _profile(model_, int(cmd[1]))
        else:
            out = {"error": f"unknown command {cmd}"}
        print(json.dumps(out), flush=True)


def read_bandwidth_gb_s(threads: int, gib: int = 1, tries: int = 5) -> float:
    """Memory read bandwidth: `threads` threads each reducing a slice of a buffer far larger than
    any cache (numpy lets go of the GIL while it reduces), the best of `tries`."""
    import threading

    import numpy as np

    buf = np.ones(gib * 2**28, dtype=np.float32)
    parts, best = np.array_split(buf, threads), 0.0
    for _ in range(tries):
        workers = [threading.Thread(target=np.max, args=(p,)) for p in parts]
        t = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        best = max(best, buf.nbytes / (time.perf_counter() - t) / 1e9)
    return round(best, 1)


def _profile(model, steps: int) -> dict:
    """One batch-1 decode step split into: every linear layer's matmul (each run alone on a
    (1, K) input), the tied LM head, and what is left (attention, norms, rope, graph)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from gmlx.engine.sampling import greedy
    from gmlx.kernels import GGUFEmbedding, GGUFLinear

    def timed(fn, reps):
        fn()
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t) / reps * 1e3

    cache = make_prompt_cache(model)
    y = greedy(model(mx.array([[1000 + i for i in range(PROMPT)]]), cache=cache)[:, -1])[:, None]
    mx.eval(y)

    def one_step():
        nonlocal y
        y = greedy(model(y, cache=cache)[:, -1])[:, None]
        mx.eval(y)

    total = timed(one_step, steps)
    linears = [mod for _, mod in model.named_modules() if isinstance(mod, GGUFLinear)]
    xs = {mod.in_features: mx.random.normal((1, mod.in_features)) for mod in linears}
    mx.eval(*xs.values())
    # a grouped linear (q/k/v, gate/up) computes its whole group: call each group once, as the model does
    calls = [next(iter(g)) for g in {id(m.group): m.group.members for m in linears if m.group}.values()]
    calls += [m for m in linears if m.group is None]

    def all_linears():  # one eval, back to back as in a step (an eval each wakes the idle pool each time)
        mx.eval([mod(xs[mod.in_features]) for mod in calls])

    lin = timed(all_linears, max(4, steps // 4))
    head = 0.0
    emb = next((mod for _, mod in model.named_modules() if isinstance(mod, GGUFEmbedding)), None)
    if emb is not None and "lm_head" not in dict(model.children()):
        x = mx.random.normal((1, emb.dims))
        head = timed(lambda: mx.eval(emb.as_linear(x)), max(4, steps // 4))
    weight_bytes = sum(mod.weight.nbytes for mod in linears) + (emb.weight.nbytes if emb is not None else 0)
    return {
        "step": round(total, 2),
        "linear_layers": round(lin, 2),
        "lm_head": round(head, 2),
        "rest": round(total - lin - head, 2),
        "linear_layers_count": len(linears),
        "linear_calls": len(calls),
        "weight_bytes_read": weight_bytes,
        "effective_gb_s": round(weight_bytes / ((lin + head) / 1e3) / 1e9, 1) if lin + head else None,
    }


def _matmuls(model: str, isas: list[str], rounds: int) -> dict:
    import mlx.core as mx

    import gmlx.kernels as gk
    from gmlx.models.loader import load

    ext = gk.extension()
    os.environ["GMLX_KERNELS_PACK"] = "0"  # the file's layouts, which every ISA takes; the packed one beside
    m = load(model, "gguf")
    shapes: dict = {}  # (kernel type, N, K) -> weight, the first module of each
    for _, mod in m.model.named_modules():
        if isinstance(mod, gk.GGUFLinear):
            t, n, k = mod.ggml_type, mod.out_features, mod.in_features
        elif isinstance(mod, gk.GGUFEmbedding):
            t, n, k = mod.ggml_type, mod.num_embeddings, mod.dims
        else:
            continue
        if (t, n, k) not in shapes:
            shapes[(t, n, k)] = mod.weight
            if t in gk.PACKABLE and n % 16 == 0:
                shapes[(gk.PACKED + t, n, k)] = ext.pack(mod.weight, t)
    threads = kernel_threads()
    best: dict = {}
    for _ in range(rounds):
        for (t, n, k), w in shapes.items():
            calls = max(1, min(32, int(4e7 // (n * k))))  # one graph of several calls: ~40 M weights
            for b in BATCHES:
                x = mx.random.normal((b, k))
                mx.eval(x)
                for isa in isas:
                    if ext.set_isa(isa) != isa:
                        raise SystemExit(f"ISA {isa} is not available here")
                    if t > gk.PACKED and not ext.packs(t - gk.PACKED):
                        continue  # no kernel for the packed layout here (generic, amx)
                    mx.eval(gk.matmul(x, w, t, n, k))
                    t0 = time.perf_counter()
                    mx.eval([gk.matmul(x, w, t, n, k) for _ in range(calls)])
                    ms = (time.perf_counter() - t0) / calls * 1e3
                    key = (t, n, k, b, isa)
                    best[key] = min(best.get(key, ms), ms)
    ext.set_isa("")
    rows = []
    for (t, n, k), _ in shapes.items():
        for b in BATCHES:
            name = f"{gk.T(t - gk.PACKED).name}_R16" if t > gk.PACKED else gk.T(t).name
            row: dict = {"type": name, "n": n, "k": k, "batch": b}
            for isa in isas:
                ms = best.get((t, n, k, b, isa))
                row[isa] = ms and {"ms": round(ms, 4), "gw_s_per_thread": round(n * k / (ms / 1e3) / 1e9 / threads, 2)}
            for isa in isas[1:]:
                first, this = best.get((t, n, k, b, isas[0])), best.get((t, n, k, b, isa))
                row[f"{isa}_vs_{isas[0]}"] = round(first / this, 2) if first and this else None
            rows.append(row)
            print(
                f"{row['type']:8} {n:6}x{k:<5} b{b}  "
                + "  ".join(
                    f"{isa} {row[isa]['ms']:8.3f} ms {row[isa]['gw_s_per_thread']:6.2f} Gw/s/thr"
                    if row[isa]
                    else f"{isa} {'-':>8}"
                    for isa in isas
                )
                + "".join(f"  x{row[f'{isa}_vs_{isas[0]}']}" for isa in isas[1:]),
                flush=True,
            )
    return {
        "model": Path(model).name,
        "threads": threads,
        "rounds": rounds,
        "isas": isas,
        "matmuls": rows,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


class _Llama:
    """llama-server -np 8 on the model; decode(b) and prefill() measure through /completion."""

    def __init__(self, model: Path):
        import httpx

        from bench.peers import peer

        port = 18000 + os.getpid() % 1000
        p = peer("llama-cpp", model, port, 1024)  # serve's command line (-np 8, 1024 tokens a slot); raises Missing
        self.version = p.version
        self.proc = subprocess.Popen(
            p.argv, env={**os.environ, **p.env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        self.url = f"http://127.0.0.1:{port}"
        self.client = httpx.Client(timeout=300)
        for _ in range(600):
            try:
                if self.client.get(f"{self.url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        else:
            self.close()
            raise RuntimeError("llama-server did not become ready")
        import random

        self.rnd = random.Random(0)
        self._complete(self._toks(PROMPT), 8)  # warm up

    def _toks(self, n: int) -> list[int]:
        return [self.rnd.randrange(1000, 20000) for _ in range(n)]

    def _complete(self, prompt: list[int], n: int) -> dict:
        r = self.client.post(
            f"{self.url}/completion",
            json={"prompt": prompt, "n_predict": n, "temperature": 0, "ignore_eos": True, "cache_prompt": False},
        )
        r.raise_for_status()
        return r.json()["timings"]

    def decode(self, b: int, steps: int) -> float:
        # each stream's own generation rate, summed: the streams run side by side in one batch
        with ThreadPoolExecutor(b) as pool:
            ts = list(pool.map(lambda _: self._complete(self._toks(PROMPT), steps), range(b)))
        return sum(t["predicted_per_second"] for t in ts)

    def prefill(self) -> float:
        return self._complete(self._toks(PREFILL), 1)["prompt_per_second"]

    def close(self) -> None:
        self.client.close()
        self.proc.terminate()
        self.proc.wait(30)


class _Gmlx:
    def __init__(self, model: Path, mode: str):
        env = dict(os.environ)
        mode_isa, _, bits = mode.partition("@")
        if ":" in mode_isa:
            env["GMLX_KERNELS_ISA"] = mode_isa.split(":")[1]
        if bits:
            env["GMLX_KERNELS_ACT_BITS"] = bits
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.bench_kernels", "--worker", mode, "--model", str(model)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.info = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("worker exited")
        return json.loads(line)

    def ask(self, cmd: str) -> dict:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self._read()

    def decode(self, b: int, steps: int) -> float:
        return self.ask(f"decode {b} {steps}")["tok_s"]

    def prefill(self) -> float:
        return self.ask("prefill")["tok_s"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--modes", default="gguf,float")
    ap.add_argument("--no-llama", action="store_true")
    ap.add_argument("--matmuls", action="store_true", help="time each matmul of the model per ISA instead")
    ap.add_argument("--isas", default="avx2,avx512", help="with --matmuls: ISAs to compare, the first the base")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()

    from gmlx.default_model import resolve_model

    model = Path(resolve_model(args.model))
    if args.matmuls:
        out = _matmuls(str(model), args.isas.split(","), args.rounds)
        RESULTS.mkdir(exist_ok=True)
        path = RESULTS / f"kernels-matmuls-{model.stem}.json"
        path.write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {path}", file=sys.stderr)
        return
    if args.worker:
        _worker(str(model), args.worker)
        return

    import gmlx
    import gmlx.kernels as gk
    from bench.peers import Missing

    result: dict = {
        "model": model.name,
        "cores": os.cpu_count(),
        "blas": gmlx.BLAS.name,
        "kernels_isa": gk.isa(),
        "kernels_reason": gk.reason(),
        "steps": args.steps,
        "rounds": args.rounds,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "load_average_1m_start": os.getloadavg()[0],
        "gmlx": {},
    }
    engines: dict = {}
    for mode in args.modes.split(","):
        engines[mode] = _Gmlx(model, mode)
        result["gmlx"][mode] = dict(engines[mode].info)
    if not args.no_llama:
        try:
            engines["llama_cpp"] = _Llama(model)
            result["llama_cpp"] = {"version": engines["llama_cpp"].version}
        except (Missing, RuntimeError) as e:
            result["llama_cpp"] = {"error": str(e)}
    # Rounds interleave the engines, and each figure is the best over rounds: on a shared machine
    # that is the figure least disturbed by other work, taken under the same conditions for all.
    best: dict = {name: {"decode_tok_s": {}, "prefill_512_tok_s": 0.0} for name in engines}
    for r in range(args.rounds):
        for name, eng in engines.items():
            for b in BATCHES:
                v = eng.decode(b, args.steps)
                d = best[name]["decode_tok_s"]
                d[str(b)] = round(max(d.get(str(b), 0.0), v), 2)
            best[name]["prefill_512_tok_s"] = round(max(best[name]["prefill_512_tok_s"], eng.prefill()), 1)
            print(f"round {r + 1}: {name} {best[name]}", file=sys.stderr, flush=True)
    if "gguf" in engines:
        result["gmlx"]["gguf"]["profile_decode_b1_ms"] = engines["gguf"].ask(f"profile {args.steps}")
    for name, eng in engines.items():
        eng.close()
        (result["gmlx"][name] if name in result["gmlx"] else result["llama_cpp"]).update(best[name])
    result["load_average_1m_end"] = os.getloadavg()[0]
    bandwidth = result["read_bandwidth_gb_s"] = read_bandwidth_gb_s(kernel_threads())
    for name, g in result["gmlx"].items():  # a decode step reads every weight once
        g["bandwidth_share"] = {
            b: round(g["resident_bytes"] * tok_s / int(b) / 1e9 / bandwidth, 2)
            for b, tok_s in g["decode_tok_s"].items()
        }
        print(f"{name}: decode at {g['bandwidth_share']} of the {bandwidth} GB/s read limit", file=sys.stderr)

    def ratio(g: dict, ref: dict) -> dict:
        return {
            **{f"decode_b{b}": round(g["decode_tok_s"][str(b)] / ref["decode_tok_s"][str(b)], 2) for b in BATCHES},
            "prefill_512": round(g["prefill_512_tok_s"] / ref["prefill_512_tok_s"], 2),
        }

    ratios = {}
    g = result["gmlx"].get("gguf", {})
    for peer, ref in (("float", result["gmlx"].get("float", {})), ("llama_cpp", result.get("llama_cpp", {}))):
        if "decode_tok_s" in g and "decode_tok_s" in ref:
            ratios[f"gguf_vs_{peer}"] = ratio(g, ref)
    isas = ":" in args.modes or "@" in args.modes  # side by side: each later mode against the first, a file of its own
    if isas:
        modes = list(result["gmlx"])
        for mode in modes[1:]:
            ratios[f"{mode}_vs_{modes[0]}"] = ratio(result["gmlx"][mode], result["gmlx"][modes[0]])
    result["ratios"] = ratios
    RESULTS.mkdir(exist_ok=True)
    tag = ("-isa" if ":" in args.modes else "") + ("-bits" if "@" in args.modes else "")
    path = RESULTS / f"kernels{tag}-{model.stem}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(ratios, indent=2))
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
