"""llama.cpp's `llama-server` and `llama-tokenize`, built once from the `llama-cpp-python` sdist.

No wheel ships llama-server, but the sdist on PyPI carries llama.cpp's sources under
vendor/llama.cpp. `build()` downloads it into a temporary folder, builds both targets with
CMake (about 5 minutes on 2 cores, under `nice`), and caches the two binaries under
~/.cache/gmlx/peers/llama.cpp-<version>-<arch>-<hash of CPU and CMake flags>/, since
GGML_NATIVE compiles for this CPU. The binaries are linked statically, so the cached folder is
self-contained.

    python -m bench build-llama [--version 0.3.36] [--force]
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from gmlx.llama_sdist import LLAMA_CPP_PYTHON, SdistError, download_sdist
from gmlx.paths import cache_dir

TARGETS = ("llama-server", "llama-tokenize")
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_CURL=OFF",
    "-DGGML_NATIVE=ON",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    # Nothing fetched at build time: no web UI from the Hugging Face bucket, no OpenSSL (loopback only).
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_LLGUIDANCE=OFF",
)
# -march=native turns on AMX where the CPU has it, and ggml's AMX matmul then dies of a general
# protection fault on its first tile config (ggml-org/llama.cpp#20824, #26954): build without it.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
if platform.machine().lower() in ("x86_64", "amd64"):
    CMAKE_FLAGS += (f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}")


class BuildError(Exception):
    """The build could not finish; the message says which step and ends with its log's tail."""


def cpu_key() -> str:
    """A short hash of this CPU's feature flags (a GGML_NATIVE binary may not run on other CPUs)
    and of the CMake flags, so a change to either builds afresh."""
    info = Path("/proc/cpuinfo")
    flags = ""
    if info.exists():
        flags = next(
            (line.split(":", 1)[1] for line in info.read_text().splitlines() if line.startswith(("flags", "Features"))),
            "",
        )
    text = (" ".join(sorted(flags.split())) or platform.processor()) + "|" + " ".join(CMAKE_FLAGS)
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def build_dir(version: str = LLAMA_CPP_PYTHON) -> Path:
    return cache_dir() / "peers" / f"llama.cpp-{version}-{platform.machine()}-{cpu_key()}"


def cached(name: str, version: str = LLAMA_CPP_PYTHON) -> Path | None:
    path = build_dir(version) / name
    return path if path.is_file() and os.access(path, os.X_OK) else None


def build_info(version: str = LLAMA_CPP_PYTHON) -> dict | None:
    path = build_dir(version) / "build.json"
    return json.loads(path.read_text()) if path.exists() else None


def _run(step: str, argv: list[str], log: Path, cwd: Path | None = None) -> None:
    with log.open("a") as out:
        out.write(f"\n$ {' '.join(argv)}\n")
        out.flush()
        rc = subprocess.run(argv, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, check=False).returncode
    if rc != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        raise BuildError(f"{step} failed (exit {rc}); full log {log}:\n{tail}")


def build(version: str = LLAMA_CPP_PYTHON, jobs: int | None = None, force: bool = False) -> Path:
    """The folder holding both binaries, built now unless already cached; raises BuildError."""
    dest = build_dir(version)
    if not force and all(cached(t, version) for t in TARGETS):
        return dest
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise BuildError(f"building llama.cpp needs `{tool}` on PATH")
    dest.parent.mkdir(parents=True, exist_ok=True)
    log = dest.parent / f"{dest.name}.build.log"
    log.write_text("")
    jobs = jobs or os.cpu_count() or 1
    nice = ["nice", "-n", "10"] if shutil.which("nice") else []  # a background build, not a benchmark
    started = time.monotonic()
    print(
        f"[bench] building llama.cpp from llama-cpp-python {version} ({jobs} jobs, log {log}) ...",
        file=sys.stderr,
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="gmlx-llama-build-") as tmp:
        work = Path(tmp)
        try:
            sdist = download_sdist(work, version, log)
        except SdistError as e:
            raise BuildError(f"{e} (full log {log})") from None
        with tarfile.open(sdist) as tar:
            tar.extractall(work, filter="data")
        source = next(work.glob("llama_cpp_python-*/vendor/llama.cpp"), None)
        if source is None or not (source / "CMakeLists.txt").exists():
            raise BuildError(f"{sdist.name} carries no vendor/llama.cpp")
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        _run("cmake configure", ["cmake", "-S", str(source), "-B", str(work / "build"), *generator, *CMAKE_FLAGS], log)
        _run(
            "cmake build", [*nice, "cmake", "--build", str(work / "build"), "-j", str(jobs), "--target", *TARGETS], log
        )
        staging = dest.with_name(dest.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        for target in TARGETS:
            binary = work / "build" / "bin" / target
            if not binary.is_file():
                raise BuildError(f"the build produced no {binary}")
            shutil.copy2(binary, staging / target)
        compiler = subprocess.run(["c++", "--version"], capture_output=True, text=True, check=False).stdout
        (staging / "build.json").write_text(
            json.dumps(
                {
                    "llama_cpp_python": version,
                    "cmake_flags": list(CMAKE_FLAGS),
                    "machine": platform.machine(),
                    "cpu_key": cpu_key(),
                    "compiler": compiler.splitlines()[0] if compiler else None,
                    "built": time.strftime("%Y-%m-%d %H:%M:%S"),
                    "build_s": round(time.monotonic() - started, 1),
                },
                indent=2,
            )
            + "\n"
        )
        shutil.rmtree(dest, ignore_errors=True)
        staging.rename(dest)  # the cache holds a complete build or none
    print(f"[bench] llama.cpp built in {time.monotonic() - started:.0f} s: {dest}", file=sys.stderr, flush=True)
    return dest


def binary(name: str, version: str = LLAMA_CPP_PYTHON) -> Path:
    """The cached `name` (one of TARGETS), building both first when missing; raises BuildError."""
    return cached(name, version) or build(version) / name
