"""`gmlx top` over a fleet: servers named on the command line with a key each (URL#KEY), in a file,
or by deploy/'s HAProxy configuration."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import LiveServer, invoke

from gmlx.tui.fleet import Target, targets

HAPROXY = Path(__file__).parent.parent / "deploy" / "haproxy" / "haproxy.cfg"


def test_urls_keys_and_files(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.txt"
    fleet.write_text("# the lab\nhttp://10.0.0.1:8080#alpha\n\n10.0.0.2:8080\n")
    assert targets(["http://a:1/#k1", "http://b:2", f"@{fleet}"], "shared") == [
        Target("http://a:1", "k1"),
        Target("http://b:2", "shared"),
        Target("http://10.0.0.1:8080", "alpha"),
        Target("http://10.0.0.2:8080", "shared"),
    ]
    assert targets(["http://a:1#"], None) == [Target("http://a:1", None)]  # an empty key is none


def test_the_haproxy_configuration_names_the_fleet(tmp_path: Path) -> None:
    env = {"GMLX_A": "10.0.0.11:8080", "GMLX_B": "10.0.0.12:8080"}
    assert targets([f"@{HAPROXY}"], "k", env) == [
        Target("http://10.0.0.11:8080", "k"),
        Target("http://10.0.0.12:8080", "k"),
    ]
    with pytest.raises(ValueError, match=r"\$\{GMLX_B\}, which is not set"):
        targets([f"@{HAPROXY}"], "k", {"GMLX_A": "10.0.0.11:8080"})
    with pytest.raises(ValueError, match="cannot read the fleet file"):
        targets(["@/nonexistent/fleet"], None)
    empty = tmp_path / "empty"
    empty.write_text("# nothing yet\n\n")
    with pytest.raises(ValueError, match="lists no server"):  # top --once said all was well
        targets([f"@{empty}"], None)


def test_top_once_with_a_key_per_server(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    model = tiny_models["llama"]
    with LiveServer(model, api_key="one") as a, LiveServer(model, api_key="two") as b:
        good = invoke("top", "--once", "--url", f"{a.url}#one", "--url", f"{b.url}#two")
        assert good.exit_code == 0, good.output
        assert good.stdout.count("tiny-llama") >= 2
        swapped = invoke("top", "--once", "--url", f"{a.url}#two", "--url", f"{b.url}#one")
        assert swapped.exit_code == 1 and "refused the API key given" in swapped.output
        keyless = invoke("top", "--once", "--url", a.url)
        assert keyless.exit_code == 1 and "needs its API key" in keyless.output
        listed = tmp_path / "fleet"
        listed.write_text(f"{a.url}#one\n{b.url}#two\n")
        assert invoke("top", "--once", "--url", f"@{listed}").exit_code == 0
    missing = invoke("top", "--once", "--url", "@/nonexistent/fleet")
    assert missing.exit_code == 2 and "cannot read the fleet file" in missing.output
