"""llama.cpp's sources, as the llama-cpp-python sdist on PyPI ships them under vendor/llama.cpp.

Two users, neither at serving time: `bench.llama_build` builds llama-server from the sdist, and
the tokenizer tests read llama.cpp's own tokenizer corpus from it (the vocab-only GGUFs with
their .inp/.out cases under vendor/llama.cpp/models). It lives in the package, not in bench/,
because the tests import gmlx but not bench. Only pip is needed: `pip download` fetches it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from gmlx.paths import cache_dir

# The release the reference files under tests/data/ came from.
LLAMA_CPP_PYTHON = "0.3.36"
_VOCAB_GLOB = "ggml-vocab-*"


class SdistError(Exception):
    """The sdist could not be downloaded or holds no llama.cpp; the message ends with pip's output tail."""


def download_sdist(dest: Path, version: str = LLAMA_CPP_PYTHON, log: Path | None = None) -> Path:
    """`llama_cpp_python-<version>.tar.gz`, downloaded by pip into `dest`; pip's output goes to `log`
    (appended) when one is given."""
    argv = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-binary",
        ":all:",
        "--no-deps",
        f"llama-cpp-python=={version}",
        "-d",
        str(dest),
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    output = proc.stdout + proc.stderr
    if log is not None:
        with log.open("a") as out:
            out.write(f"\n$ {' '.join(argv)}\n{output}")
    if proc.returncode != 0:
        tail = "\n".join(output.splitlines()[-15:])
        raise SdistError(f"pip download llama-cpp-python=={version} failed (exit {proc.returncode}):\n{tail}")
    sdist = next(dest.glob("llama_cpp_python-*.tar.gz"), None)
    if sdist is None:
        raise SdistError(f"pip download left no llama_cpp_python-*.tar.gz in {dest}")
    return sdist


def vocab_corpus(version: str = LLAMA_CPP_PYTHON) -> Path:
    """The folder of llama.cpp's tokenizer test vocabularies (`ggml-vocab-<name>.gguf` and, for most,
    `.gguf.inp`/`.gguf.out`), extracted once from the sdist into the cache (about 100 MB)."""
    dest = cache_dir() / f"llama.cpp-vocabs-{version}"
    if dest.is_dir():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gmlx-llama-sdist-", dir=dest.parent) as tmp:
        work = Path(tmp)
        sdist = download_sdist(work, version)
        staging = work / "vocabs"
        staging.mkdir()
        with tarfile.open(sdist) as tar:
            for member in tar:
                parts = Path(member.name).parts
                if (
                    member.isfile()
                    and parts[1:-1] == ("vendor", "llama.cpp", "models")
                    and Path(parts[-1]).match(_VOCAB_GLOB)
                ):
                    with tar.extractfile(member) as src, (staging / parts[-1]).open("wb") as out:
                        shutil.copyfileobj(src, out)
        if not any(staging.glob("*.gguf")):
            raise SdistError(f"{sdist.name} carries no vendor/llama.cpp/models/{_VOCAB_GLOB}.gguf")
        try:
            os.rename(staging, dest)  # the cache holds the whole corpus or none
        except OSError:
            if not dest.is_dir():  # else a concurrent run finished first, with the same files
                raise
    return dest
