"""The servers `python -m bench serve` compares, each started the same way: loopback port, same
model file, greedy, width-8 batching, prompt caches off.

llama.cpp's `llama-server` comes from no wheel: the harness looks at $GMLX_LLAMA_SERVER, then the
build cached by bench/llama_build.py, then PATH, and when none has it builds it from the
`llama-cpp-python` sdist (about 5 minutes on 2 cores; `python -m bench build-llama` does it ahead
of a run). A failed build reports the peer as missing, with the reason.
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
from bench import llama_build
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
    system_route: str | None = None  # a GET route naming the compute type it runs in (gmlx's /system)
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
    argv = [
        sys.executable,
        "-m",
        "gmlx",
        "serve",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--decode-batch",
        str(WIDTH),
        "--prompt-cache-bytes",
        "0",
        "--log-level",
        "warning",
    ]  # weights auto: gguf on a CPU
    return Peer(
        "gmlx",
        argv,
        gmlx.__version__,
        env={"GMLX_API_KEY": ""},
        system_route="/system",
        notes="no ignore_eos: a stream may stop at EOS; rates use the usage counts; no prompt cache",
    )


def llama_server_path() -> Path:
    """$GMLX_LLAMA_SERVER, the cached build, PATH, else a build now; raises Missing if it fails."""
    for candidate in (
        os.environ.get("GMLX_LLAMA_SERVER"),
        llama_build.cached("llama-server"),
        shutil.which("llama-server"),
    ):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return Path(candidate)
    try:
        return llama_build.binary("llama-server")
    except llama_build.BuildError as e:
        raise Missing(f"llama-server is not installed and building it failed: {e}") from None


def _llama_cpp(model: Path, port: int, context: int) -> Peer:
    binary = llama_server_path()
    # The cached build is static; a binary from elsewhere may link llama.cpp's libraries beside it.
    env = {"LD_LIBRARY_PATH": os.pathsep.join(filter(None, [str(binary.parent), os.environ.get("LD_LIBRARY_PATH")]))}
    out = subprocess.run(
        [str(binary), "--version"], capture_output=True, text=True, timeout=30, check=False, env={**os.environ, **env}
    )
    ver = next(
        (
            line.split(":", 1)[1].strip()
            for line in (out.stdout + out.stderr).splitlines()
            if line.startswith("version:")
        ),
        "unknown",
    )
    if binary.parent == llama_build.build_dir():
        ver += f" (built from the llama-cpp-python {llama_build.LLAMA_CPP_PYTHON} sdist)"
    # -c is shared among the -np slots: each slot gets the context the longest prompt needs.
    argv = [
        str(binary),
        "-m",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-np",
        str(WIDTH),
        "-t",
        str(cores()),
        "-c",
        str(context * WIDTH),
        "--cont-batching",
        "--no-cache-prompt",
        "--cache-ram",
        "0",
        "--no-webui",
        "--log-disable",
    ]
    return Peer("llama-cpp", argv, ver, env=env, body={"ignore_eos": True, "cache_prompt": False}, ignores_eos=True)


def _mlx_lm(model: Path, port: int, context: int) -> Peer:
    try:
        ver = version("mlx-lm")
    except PackageNotFoundError:
        raise Missing("mlx-lm is not installed") from None
    if gmlx.BLAS.name != "openblas" or gmlx.BLAS.path is None:
        raise Missing(f"no OpenBLAS to preload (gmlx found {gmlx.BLAS.name}); mlx-lm would run on reference BLAS")
    try:
        out = export_for_mlx_lm(model)
    except subprocess.CalledProcessError as e:
        raise Missing(f"`gmlx export` of {model.name} for mlx-lm failed (exit {e.returncode})") from None
    argv = [
        sys.executable,
        "-m",
        "mlx_lm",
        "server",
        "--model",
        str(out),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--decode-concurrency",
        str(WIDTH),
        "--prompt-concurrency",
        str(WIDTH),
        "--prompt-cache-size",
        "0",
        "--log-level",
        "WARNING",
    ]
    env = {"LD_PRELOAD": gmlx.BLAS.path, "OPENBLAS_NUM_THREADS": str(cores())}
    return Peer("mlx-lm", argv, ver, env=env, notes="f32 weights from `gmlx export`; no ignore_eos")


def export_for_mlx_lm(model: Path) -> Path:
    """The float32 export of `model`, made once per file version (outside any timed cell)."""
    st = model.stat()
    out = cache_dir() / "peers" / "mlx" / f"{model.stem}-{st.st_size}-{st.st_mtime_ns}-f32"
    if not (out / "model.safetensors").exists():
        subprocess.run([sys.executable, "-m", "gmlx", "export", str(model), str(out), "--weights", "float"], check=True)
    return out
