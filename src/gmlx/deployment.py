"""A deployment: one model as gmlx serves it, built once and used by `gmlx serve`, `gmlx plan` and
`gmlx estimate` alike: its id, its file, its resolved settings (the server's, with its preset's
over them) and its header, from which come its weight mode and its capacity table before any
weight is read. A server holds one per model it may serve (server/residency.py); the engine that
runs one is built from it (server/build.py)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from gmlx import platform
from gmlx.capacity.kv_quant import KVQuantPlan
from gmlx.capacity.table import CapacityTable, header_table
from gmlx.gguf.header import GGUFHeader, read_header
from gmlx.models.weights_mode import choose_mode, resident_bytes
from gmlx.presets import Preset
from gmlx.settings import Settings, SettingsError, for_model

Origin = str  # "argument" (the positional model, preloaded), "preset" or "models_dir"


@dataclass(frozen=True)
class Deployment:
    model_id: str
    path: Path
    settings: Settings
    origin: Origin = "argument"

    @property
    def header(self) -> GGUFHeader:
        """Read on first use, and again once the file changes: a models directory may hold many
        files no request names, and a file may be replaced in place."""
        try:
            st = self.path.stat()
        except OSError:
            return read_header(self.path)  # which says what is wrong with the path, as a GGUFError
        return _header(str(self.path), st.st_mtime_ns, st.st_size)

    @property
    def mode(self) -> str:
        return choose_mode(self.settings.weights, self.header)  # type: ignore[arg-type]

    @property
    def context_length(self) -> int:
        """The window it would serve, from its header: the GGUF's, or max_kv_size when smaller
        (what LoadedModel.context_length says once it is loaded)."""
        trained, cap = self.header.geometry.context_length, self.settings.max_kv_size
        return trained if cap is None else min(trained, cap)

    @property
    def memory(self) -> int:
        """The memory its table plans with: the setting, or the device's or system's."""
        return self.settings.memory or platform.total_memory_bytes()

    @property
    def planned_weight_bytes(self) -> int:
        """Its weights as its mode loads them, its drafter's included, from the headers alone."""
        own = resident_bytes(self.header, self.mode)
        if not self.settings.draft:
            return own
        drafter = read_header(self.settings.draft)
        return own + resident_bytes(drafter, choose_mode(self.settings.weights, drafter))  # type: ignore[arg-type]

    def planned_table(self, others_bytes: int = 0) -> tuple[CapacityTable, KVQuantPlan | None]:
        """The table and KV quantization plan a server would build for it beside `others_bytes` of
        other models' weights, from headers alone (the server measures the rest once loaded)."""
        from gmlx.kernels import fast  # imports mlx: after the platform's bring-up

        return header_table(
            self.header,
            self.settings,
            mode=self.mode,
            memory=self.memory,
            fast_kernels=fast.enabled(),
            host_memory=platform.backend() != "cuda",
            others_bytes=others_bytes,
        )


@lru_cache(maxsize=64)
def _header(path: str, mtime_ns: int, size: int) -> GGUFHeader:
    return read_header(path)


def deployments(
    s: Settings, served: Path, presets: dict[str, Preset], folder_files: dict[str, Path]
) -> dict[str, Deployment]:
    """Every model a server with settings `s` may serve, by id, the positional model (`served`)
    first: then the presets, then the models directory's files no preset or argument names
    (under the server's settings). The positional file keeps its preset's id and settings when a
    preset names it; an id naming two files is a SettingsError."""
    by_path = {p.path.resolve(): p for p in presets.values()}
    first = by_path.get(served.resolve())
    out = {(first.id if first else served.stem): _deploy(s, first, served, "argument")}
    for p in presets.values():
        if p is not first:
            _add(out, _deploy(s, p, p.path, "preset"))
    taken = {d.path.resolve() for d in out.values()}
    for model_id, path in sorted(folder_files.items()):
        if path.resolve() not in taken:  # a file a preset or the argument names is served by that id
            _add(out, Deployment(model_id, path, s, "models_dir"))
    return out


def _deploy(s: Settings, preset: Preset | None, path: Path, origin: Origin) -> Deployment:
    if preset is None:
        return Deployment(path.stem, path, s, origin)
    return Deployment(preset.id, preset.path, for_model(s, preset.settings, f"preset {preset.id!r}"), origin)


def _add(out: dict[str, Deployment], d: Deployment) -> None:
    if d.model_id in out:
        raise SettingsError(f"model id {d.model_id!r} names two files: {out[d.model_id].path} and {d.path}")
    out[d.model_id] = d
