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


@pytest.mark.skipif(not hasattr(__import__("os"), "sched_setaffinity"), reason="thread affinity is Linux's")
def test_openblas_takes_a_thread_for_each_cpu_the_process_may_run_on() -> None:
    """In a container held to one CPU of a bigger machine (here: an affinity of one CPU), OpenBLAS
    gets one thread, not one for each of the machine's CPUs."""
    import os
    import subprocess
    import sys

    first = min(os.sched_getaffinity(0))
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    code = "import os\nfrom gmlx import platform\nprint(platform.usable_cpus(), os.environ['OPENBLAS_NUM_THREADS'])"
    r = subprocess.run(
        [sys.executable, "-c", code],
        preexec_fn=lambda: os.sched_setaffinity(0, {first}),
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["1", "1"]
    assert platform.usable_cpus() == len(os.sched_getaffinity(0))
