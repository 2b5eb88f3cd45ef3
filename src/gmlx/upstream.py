"""Every reach into a library's private parts, in one place, with the version it was checked against.

gmlx leans on a few things mlx_lm, uvicorn and typer do not promise. Each is named here once;
the rest of gmlx calls these functions, and `tests/test_upstream.py` checks each one's behaviour
on the installed version, so an upgrade that changes one fails there, by name, rather than deep
in a request. `pyproject.toml` pins mlx-lm and uvicorn to the ranges checked.

The libraries are imported when first used: `gmlx top` and the completions must not pay for
mlx_lm, and mlx must be imported after gmlx.platform's BLAS bring-up.
"""

from __future__ import annotations

import signal
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from transformers import PreTrainedTokenizerFast
    from uvicorn import Server

CHECKED = {"mlx-lm": "0.32.2", "uvicorn": "0.54.0", "typer": "0.29.2"}


def __getattr__(name: str) -> Any:
    """The class gmlx subclasses, resolved when first asked for (PEP 562)."""
    if name == "H11Protocol":  # gmlx.server.connections relies on its cycle, conn, transport and connections
        from uvicorn.protocols.http.h11_impl import H11Protocol

        return H11Protocol
    raise AttributeError(name)


# --- mlx_lm -------------------------------------------------------------------------------


def hf_tokenizer(wrapper: TokenizerWrapper) -> PreTrainedTokenizerFast:
    """The transformers tokenizer a TokenizerWrapper holds (it forwards most calls, not all)."""
    return wrapper._tokenizer


def right_padding(cache: BatchKVCache) -> mx.array | None:
    """Per row, the padding slots after a right-padded prefill chunk's real tokens (None outside one)."""
    return cache._right_padding


def filled(cache: BatchKVCache) -> int:
    """Slots a BatchKVCache has written along the sequence axis (its keys may be longer)."""
    return cache._idx


def set_filled(cache: BatchKVCache, slots: int) -> None:
    cache._idx = slots


# --- uvicorn ------------------------------------------------------------------------------


def forget_signals(server: Server, signals: Iterable[int] = (signal.SIGTERM, signal.SIGINT)) -> None:
    """uvicorn re-raises each signal it handled once it has stopped; forget these."""
    drop = set(signals)
    server._captured_signals = [s for s in server._captured_signals if s not in drop]


# --- typer --------------------------------------------------------------------------------


def completion_script(prog_name: str, complete_var: str, shell: str) -> str:
    """The completion script typer would install for `shell` (it has no public way to ask for
    another shell's script than the one it detects)."""
    from typer._completion_shared import get_completion_script

    return get_completion_script(prog_name=prog_name, complete_var=complete_var, shell=shell)
