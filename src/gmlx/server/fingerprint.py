"""`system_fingerprint`: which build and which model file answered, as OpenAI's field means it.

OpenAI changes the value when the backend changes in a way that can change answers for the same
seed. Here that is gmlx's version, the model file, the weights mode (`gguf` blocks, `native`,
`float` compute differently) and the KV-cache quantization. The file is identified by its size and
a hash of its GGUF header (metadata and tensor table), read once: the weights are not hashed, which
would read gigabytes at start, so two files alike in header and size but not in weights would share
a value. It is stable across restarts and machines for the same file and settings.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

import gmlx
from gmlx.engine.engine import Engine


@functools.cache
def _header_digest(path: Path, data_offset: int, size: int) -> str:
    h = hashlib.sha256(str(size).encode())
    with path.open("rb") as f:
        while (remaining := data_offset - f.tell()) > 0 and (block := f.read(min(remaining, 1 << 20))):
            h.update(block)
    return h.hexdigest()


def system_fingerprint(engine: Engine) -> str:
    """`fp_` and 12 hex digits over the version, the file, the weights mode and the KV quantization."""
    loaded = engine.loaded
    assert loaded is not None
    header = loaded.header
    kv_quant = getattr(engine, "kv_quant", None)
    parts = [
        gmlx.__version__,
        _header_digest(header.path, header.data_offset, header.file_size),
        loaded.mode,
        json.dumps(kv_quant.to_json() if kv_quant is not None else None, sort_keys=True),
    ]
    return "fp_" + hashlib.sha256("\n".join(parts).encode()).hexdigest()[:12]
