"""``mesh service install|uninstall``: the rendered files and the commands, in a temp HOME."""

from __future__ import annotations

import plistlib
import stat
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mesh.cli import app
from mesh.cli import service as service_module
from mesh.cli.service import render_launchd_plist, render_systemd_unit

runner = CliRunner()


def flat(text: str) -> str:
    """Output with rich's line wrapping undone."""
    return " ".join(text.split())


@pytest.fixture
def user_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "user"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("MLX_MESH_HOME", raising=False)
    return home


@pytest.fixture
def fake_systemctl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A systemctl on PATH that logs its arguments (and fails when told to), so no real bus."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "systemctl.log"
    script = bin_dir / "systemctl"
    script.write_text(
        f'#!/bin/sh\necho "$@" >> {log}\n'
        'if [ -n "$FAIL_SYSTEMCTL" ]; then echo "Failed to connect to bus" >&2; exit 1; fi\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    return log


def test_systemd_unit_runs_mesh_up_with_quoting() -> None:
    unit = render_systemd_unit(["/opt/my venv/bin/mesh", "up", "--name", "50%"], Path("/h/x y"))
    assert 'ExecStart="/opt/my venv/bin/mesh" up --name 50%%\n' in unit
    assert 'Environment="MLX_MESH_HOME=/h/x y"\n' in unit
    assert "WantedBy=default.target" in unit
    assert "Restart=on-failure" in unit


def test_launchd_plist_is_valid_and_runs_at_load() -> None:
    text = render_launchd_plist(
        ["/bin/mesh", "up", "--home", "/h<&>"], Path("/h<&>"), Path("/logs")
    )
    agent = plistlib.loads(text.encode())
    assert agent["Label"] == "dev.mlx-mesh.node"
    assert agent["ProgramArguments"] == ["/bin/mesh", "up", "--home", "/h<&>"]
    assert agent["RunAtLoad"] is True
    assert agent["EnvironmentVariables"] == {"MLX_MESH_HOME": "/h<&>"}
    assert agent["StandardErrorPath"] == "/logs/node.log"


def test_dry_run_prints_and_writes_nothing(user_home: Path) -> None:
    result = runner.invoke(
        app,
        [
            "service",
            "install",
            "--dry-run",
            "--platform",
            "linux",
            "--home",
            "/srv/mesh",
            "--",
            "--model",
            "m1",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "[Service]" in result.stdout
    assert "up --home /srv/mesh --model m1" in result.stdout
    assert "would write" in flat(result.stderr)
    assert not (user_home / ".config").exists()

    mac = runner.invoke(app, ["service", "install", "--dry-run", "--platform", "darwin"])
    assert mac.exit_code == 0, mac.output
    agent = plistlib.loads(mac.stdout.encode())
    assert agent["ProgramArguments"][1:] == ["up", "--home", str(user_home / ".mlx-mesh")]
    assert not (user_home / "Library").exists()


def test_linux_install_and_uninstall_register_with_systemctl(
    user_home: Path, fake_systemctl: Path
) -> None:
    unit = user_home / ".config/systemd/user/mlx-mesh.service"
    result = runner.invoke(app, ["service", "install", "--platform", "linux"])
    assert result.exit_code == 0, result.output
    assert unit.exists() and "ExecStart=" in unit.read_text()
    assert fake_systemctl.read_text().splitlines() == [
        "--user daemon-reload",
        "--user enable mlx-mesh.service",
    ]
    assert "start at login" in result.stdout

    result = runner.invoke(app, ["service", "uninstall", "--platform", "linux"])
    assert result.exit_code == 0, result.output
    assert not unit.exists()
    assert fake_systemctl.read_text().splitlines()[2:] == [
        "--user disable mlx-mesh.service",
        "--user daemon-reload",
    ]
    again = runner.invoke(app, ["service", "uninstall", "--platform", "linux"])
    assert again.exit_code == 0 and "no service installed" in flat(again.stdout)


def test_missing_user_bus_is_a_note_not_a_crash(
    user_home: Path, fake_systemctl: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAIL_SYSTEMCTL", "1")
    result = runner.invoke(app, ["service", "install", "--platform", "linux"])
    assert result.exit_code == 0, result.output
    assert "Failed to connect to bus" in flat(result.stderr)
    assert "not enabled; run `systemctl --user enable mlx-mesh.service`" in flat(result.stderr)
    assert (user_home / ".config/systemd/user/mlx-mesh.service").exists()
    result = runner.invoke(app, ["service", "uninstall", "--platform", "linux"])
    assert result.exit_code == 0, result.output
    assert not (user_home / ".config/systemd/user/mlx-mesh.service").exists()


def test_macos_install_without_launchctl_writes_the_agent(
    user_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    result = runner.invoke(
        app, ["service", "install", "--platform", "darwin", "--home", str(tmp_path / "mh")]
    )
    assert result.exit_code == 0, result.output
    plist = user_home / "Library/LaunchAgents/dev.mlx-mesh.node.plist"
    assert plistlib.loads(plist.read_bytes())["Label"] == "dev.mlx-mesh.node"
    assert (tmp_path / "mh" / "logs").is_dir()
    assert "launchctl not found" in flat(result.stderr)
    assert "loads it at your next login" in flat(result.stderr)


def test_unwritable_location_is_one_clear_sentence(user_home: Path) -> None:
    (user_home / ".config").write_text("a file where a directory should be")
    result = runner.invoke(app, ["service", "install", "--platform", "linux", "--no-register"])
    assert result.exit_code == 1
    assert "cannot write" in flat(result.stderr)
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_unsupported_platform_is_refused(user_home: Path) -> None:
    result = runner.invoke(app, ["service", "install", "--platform", "win32", "--dry-run"])
    assert result.exit_code == 1
    assert "macOS and Linux" in flat(result.stderr)


def test_the_service_runs_the_mesh_script_of_this_install() -> None:
    command = service_module.mesh_executable()
    assert Path(command[0]).exists()


def test_this_machine_gets_its_own_kind_of_service(user_home: Path) -> None:
    result = runner.invoke(app, ["service", "install", "--dry-run"])
    assert result.exit_code == 0, result.output
    expected = "<plist" if sys.platform == "darwin" else "[Service]"
    assert expected in result.stdout
