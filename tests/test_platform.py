"""Platform facts: memory totals."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from gmlx import platform

GiB = 2**30


def test_total_memory_honours_cgroup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    physical = psutil.virtual_memory().total
    v2, v1 = tmp_path / "memory.max", tmp_path / "limit_in_bytes"
    monkeypatch.setattr(platform, "CGROUP_LIMIT_FILES", (v2, v1))
    assert platform.total_memory_bytes() == physical  # neither file exists
    v2.write_text("max\n")
    v1.write_text("9223372036854771712\n")
    assert platform.total_memory_bytes() == physical
    v2.write_text("1073741824\n")
    assert platform.total_memory_bytes() == min(physical, GiB)
