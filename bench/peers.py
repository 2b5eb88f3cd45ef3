"""The servers `python -m bench serve` compares, each started the same way: loopback port, same
model file, greedy, width-8 batching, prompt caches off.

llama.cpp's `llama-server` comes from no wheel. Build it once from the llama.cpp sources that
the `llama-cpp-python` sdist carries (about 5 minutes on 2 cores), and cache the binary:

    pip download --no-binary :all: --no-deps llama-cpp-python -d /tmp/lcpp
    tar xzf /tmp/lcpp/llama_cpp_python-*.tar.gz -C /tmp/lcpp
    cd /tmp/lcpp/llama_cpp_python-*/vendor/llama.cpp
    cmake -S . -B build -G Ninja -DLLAMA_BUILD_SERVER=ON -DLLAMA_CURL=OFF -DGGML_NATIVE=ON \\
        -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
    cmake --build build --target llama-server -j2
    mkdir -p ~/.cache/gmlx/peers && cp -a build/bin/llama-server build/bin/lib*.so* ~/.cache/gmlx/peers/

The harness looks at $GMLX_LLAMA_SERVER, then ~/.cache/gmlx/peers/llama-server, then PATH, and
puts the binary's folder on LD_LIBRARY_PATH (it links llama.cpp's shared libraries).
`mlx_lm.server` runs on the model exported by `gmlx export --weights float` (cached under
~/.cache/gmlx/peers/mlx/), with the same OpenBLAS gmlx preloads, through LD_PRELOAD.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import gmlx
from gmlx.paths import cache_dir

PEERS = ("gmlx", "llama-cpp", "mlx-lm")
WIDTH = 8  # every server batches up to this many streams


@dataclass(frozen=True)
class Peer:
    name: str
    argv: list[str]
    version: str
    env: dict[str, str] = field(default_factory=dict)
    body: dict = field(default_factory=dict)  # extra request fields this server understands
    ignores_eos: bool = False
    notes: str = ""


class Missing(Exception):
    """A peer that cannot run here; the report names it with this reason."""


def cores() -> int:
    return os.cpu_count() or 1


def peer(name: str, model: Path, port: int, context: int) -> Peer:
    """How to start `name` on `model`; raises Missing with the reason when it cannot run here."""
    return {"gmlx": _gmlx, "llama-cpp": _llama_cpp, "mlx-lm": _mlx_lm}[name](model, port, context)


def _gmlx(model: Path, port: int, context: int) -> Peer:
    argv = [sys.executable, "-m", "gmlx", "serve", str(model), "--host", "127.0.0.1", "--port", str(port),
            "--decode-batch", str(WIDTH), "--prompt-cache-bytes", "0",
            "--log-level", "warning"]  # weights auto: gguf on a CPU
    return Peer("gmlx", argv, gmlx.__version__, env={"GMLX_API_KEY": ""},
                notes="no ignore_eos: a stream may stop at EOS; rates use the usage counts; no prompt cache")


def llama_server_path() -> Path:
    for candidate in (os.environ.get("GMLX_LLAMA_SERVER"), cache_dir() / "peers" / "llama-server",
                      shutil.which("llama-server")):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return Path(candidate)
    raise Missing("llama-server not found ($GMLX_LLAMA_SERVER, ~/.cache/gmlx/peers/llama-server or PATH); "
                  "build it as bench/peers.py says")


def _llama_cpp(model: Path, port: int, context: int) -> Peer:
    binary = llama_server_path()
    env = {"LD_LIBRARY_PATH": os.pathsep.join(filter(None, [str(binary.parent), os.environ.get("LD_LIBRARY_PATH")]))}
    out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30, check=False,
                         env={**os.environ, **env})
    ver = next((line for line in (out.stdout + out.stderr).splitlines() if line.startswith("version")), "unknown")
    # -c is shared among the -np slots: each slot gets the context the longest prompt needs.
    argv = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-np", str(WIDTH),
            "-t", str(cores()), "-c", str(context * WIDTH), "--cont-batching", "--no-cache-prompt",
            "--cache-ram", "0", "--no-webui", "--log-disable"]
    return Peer("llama-cpp", argv, ver, env=env, body={"ignore_eos": True, "cache_prompt": False}, ignores_eos=True)


def _mlx_lm(model: Path, port: int, context: int) -> Peer:
    try:
        ver = version("mlx-lm")
    except PackageNotFoundError:
        raise Missing("mlx-lm is not installed") from None
    if gmlx.BLAS.name != "openblas" or gmlx.BLAS.path is None:
        raise Missing(f"no OpenBLAS to preload (gmlx found {gmlx.BLAS.name}); mlx-lm would run on reference BLAS")
    out = export_for_mlx_lm(model)
    argv = [sys.executable, "-m", "mlx_lm", "server", "--model", str(out), "--host", "127.0.0.1",
            "--port", str(port), "--decode-concurrency", str(WIDTH), "--prompt-concurrency", str(WIDTH),
            "--prompt-cache-size", "0", "--log-level", "WARNING"]
    env = {"LD_PRELOAD": gmlx.BLAS.path, "OPENBLAS_NUM_THREADS": str(cores())}
    return Peer("mlx-lm", argv, ver, env=env, notes="f32 weights from `gmlx export`; no ignore_eos")


def export_for_mlx_lm(model: Path) -> Path:
    """The float32 export of `model`, made once per file version (outside any timed cell)."""
    st = model.stat()
    out = cache_dir() / "peers" / "mlx" / f"{model.stem}-{st.st_size}-{st.st_mtime_ns}-f32"
    if not (out / "model.safetensors").exists():
        subprocess.run([sys.executable, "-m", "gmlx", "export", str(model), str(out), "--weights", "float"],
                       check=True)
    return out
