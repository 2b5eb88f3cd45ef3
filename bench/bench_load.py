"""Header read and model load times on the default model (or a given GGUF), against gguf's own reader.

    python bench/bench_load.py [MODEL.gguf] [--repeat 3]

Prints one JSON object; the peer is `gguf.GGUFReader` in the same run, so the ratio holds on a
noisy shared machine where absolute seconds do not.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import gmlx  # noqa: F401  (BLAS before mlx)
from gmlx.default_model import resolve_model
from gmlx.gguf.header import read_header

# Each load runs in a fresh process: a warm process reuses freed memory and flatters the figure.
_LOAD = """
import sys, time, json
t = time.perf_counter()
from gmlx.models.loader import load
t_import = time.perf_counter() - t
m = load(sys.argv[1], sys.argv[2])
print(json.dumps({"import_s": t_import, "load_s": m.load_seconds, "resident_bytes": m.report.resident_bytes}))
"""


def timed(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    path = resolve_model(args.model)

    from gguf import GGUFReader

    ours = timed(lambda: read_header(path).geometry, args.repeat)
    peer = timed(lambda: GGUFReader(path), 1)
    out = {
        "model": str(path),
        "header_s": round(ours, 4),
        "gguf_reader_s": round(peer, 3),
        "header_speedup": round(peer / ours, 1),
        "load": {},
    }
    from gmlx import kernels

    for mode in ("native", "float") + (("gguf",) if kernels.reason() is None else ()):
        runs = [
            json.loads(subprocess.check_output([sys.executable, "-c", _LOAD, str(path), mode]))
            for _ in range(args.repeat)
        ]
        out["load"][mode] = {
            "load_s": round(statistics.median(r["load_s"] for r in runs), 2),
            "import_s": round(statistics.median(r["import_s"] for r in runs), 2),
            "resident_bytes": runs[0]["resident_bytes"],
        }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
