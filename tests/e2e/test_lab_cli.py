"""`mesh lab` on the command line: argument checks, and a probe run that writes its outputs."""

from __future__ import annotations

import socket
from pathlib import Path

from typer.testing import CliRunner

from mesh.cli import app


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_probe_command_writes_outputs_even_when_the_gateway_is_down(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{_closed_port()}"
    result = CliRunner().invoke(
        app,
        ["lab", "probe", "--url", url, "--count", "1", "--out", str(tmp_path), "--timeout", "2"],
    )
    assert result.exit_code == 0, result.output  # nothing hung: refused is a failure, not a hang
    assert {"rows.jsonl", "summary.json", "summary.md", "failures.png"} <= {
        p.name for p in tmp_path.iterdir()
    }
    assert "transport_error 1" in (tmp_path / "summary.md").read_text()


def test_probe_command_rejects_bad_arguments(tmp_path: Path) -> None:
    runner = CliRunner()
    both = runner.invoke(
        app, ["lab", "probe", "--url", "http://x", "--count", "1", "--duration", "1"]
    )
    assert both.exit_code == 1 and "not both" in both.output
    apis = runner.invoke(app, ["lab", "probe", "--url", "http://x", "--apis", "chat,smoke"])
    assert apis.exit_code == 1 and "smoke" in apis.output
    no_node = runner.invoke(app, ["lab", "probe", "--home", str(tmp_path), "--count", "1"])
    assert no_node.exit_code == 1 and "no node is running" in no_node.output


def test_run_command_names_the_bundled_scenarios_when_one_is_unknown() -> None:
    result = CliRunner().invoke(app, ["lab", "run", "no-such-scenario"])
    assert result.exit_code == 2
    listing = CliRunner().invoke(app, ["lab", "scenarios"])
    assert (
        listing.exit_code == 0
        and "partition-heal" in listing.output
        and "sigstop" in listing.output
    )
