"""Which servers `gmlx top` watches, each with its own key. A `--url` is `URL`, `URL#KEY`, or `@FILE`:
a file of such lines (one a line; blank lines and lines starting with `#` are skipped), or an
HAProxy configuration, whose `server` lines name the fleet (addresses written as `${VAR}` are read
from the environment, as HAProxy reads them). A server given without a key gets `--api-key`. A key
on the command line shows in `ps`: a file readable only by you keeps it private."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

_SERVER = re.compile(r"^\s*server\s+\S+\s+(\S+)")
_SECTION = re.compile(r"^\s*(backend|listen|frontend|defaults|global)\b")
_VAR = re.compile(r"\$\{(\w+)(?:-([^}]*))?\}")


@dataclass(frozen=True)
class Target:
    url: str
    api_key: str | None


def targets(specs: Sequence[str | Target], api_key: str | None, env: Mapping[str, str] = os.environ) -> list[Target]:
    """Every server the specs name, in order (a Target stays as it is). Raises ValueError for a file
    that cannot be read, or an HAProxy address whose variable is unset."""
    out: list[Target] = []
    for spec in specs:
        if isinstance(spec, Target):
            out.append(spec)
        else:
            out += _from_file(Path(spec[1:]), api_key, env) if spec.startswith("@") else [target(spec, api_key)]
    return out


def target(spec: str, api_key: str | None) -> Target:
    """`URL` or `URL#KEY`; a bare `host:port` is taken as http."""
    url, sep, key = spec.strip().partition("#")
    url = url if "://" in url else f"http://{url}"
    return Target(url.rstrip("/"), key if sep and key else api_key)


def _from_file(path: Path, api_key: str | None, env: Mapping[str, str]) -> list[Target]:
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise ValueError(f"cannot read the fleet file {str(path)!r}: {e.strerror or e}") from None
    if not any(_SECTION.match(line) for line in lines):
        listed = [target(line, api_key) for line in lines if line.strip() and not line.lstrip().startswith("#")]
        if not listed:  # watching nothing would say all is well
            raise ValueError(f"the fleet file {str(path)!r} lists no server")
        return listed
    found = [_address(m.group(1).strip('"'), path, env) for line in lines if (m := _SERVER.match(line))]
    if not found:
        raise ValueError(f"the HAProxy configuration {str(path)!r} has no server lines")
    return [target(address, api_key) for address in found]


def _address(address: str, path: Path, env: Mapping[str, str]) -> str:
    def value(m: re.Match[str]) -> str:
        name, default = m.group(1), m.group(2)
        if name in env:
            return env[name]
        if default is None:
            raise ValueError(f"{str(path)!r} names a server by ${{{name}}}, which is not set")
        return default

    return _VAR.sub(value, address)
