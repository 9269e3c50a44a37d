"""Command groups other packages add to ``mesh`` by entry point (``mesh/cli/plugins.py``):
found in installed metadata and in a checkout's own pyproject.toml, and added to the app."""

from __future__ import annotations

from importlib.metadata import EntryPoint
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from mesh.cli import plugins
from mesh.cli.plugins import GROUP, add_command_groups, declared_groups

# What a fake entry point in these tests loads.
extra_app = typer.Typer(name="extra", no_args_is_help=True)


@extra_app.command("hello")
def _hello() -> None:
    typer.echo("hello from extra")


@extra_app.command("bye")
def _bye() -> None:
    typer.echo("bye")


not_a_typer = object()


def _pyproject(tmp_path: Path, name: str, groups: dict[str, str]) -> Path:
    lines = [f'[project]\nname = "{name}"\n', f'[project.entry-points."{GROUP}"]']
    lines += [f'{key} = "{value}"' for key, value in groups.items()]
    path = tmp_path / "pyproject.toml"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture
def installed(monkeypatch: pytest.MonkeyPatch) -> list[EntryPoint]:
    """The entry points the installed metadata declares (none until a test adds some)."""
    declared: list[EntryPoint] = []
    monkeypatch.setattr(
        plugins, "entry_points", lambda group: [e for e in declared if e.group == group]
    )
    return declared


def test_installed_groups_are_found(installed: list[EntryPoint], tmp_path: Path) -> None:
    installed.append(EntryPoint(name="extra", value=f"{__name__}:extra_app", group=GROUP))
    installed.append(EntryPoint(name="other", value="x:y", group="someone.else"))
    found = declared_groups(pyproject=tmp_path / "none.toml")
    assert [(e.name, e.value) for e in found] == [("extra", f"{__name__}:extra_app")]


def test_a_checkout_reads_its_own_pyproject_and_wins_over_stale_metadata(
    installed: list[EntryPoint], tmp_path: Path
) -> None:
    installed.append(EntryPoint(name="lab", value="old.place:lab_app", group=GROUP))
    installed.append(EntryPoint(name="zoo", value="zoo:app", group=GROUP))
    pyproject = _pyproject(tmp_path, "mlx-mesh", {"lab": "lab.cli:lab_app", "extra": "e:app"})
    found = declared_groups(pyproject=pyproject)
    assert [(e.name, e.value) for e in found] == [
        ("extra", "e:app"),
        ("lab", "lab.cli:lab_app"),
        ("zoo", "zoo:app"),
    ]


def test_another_projects_pyproject_is_not_read(installed: list[EntryPoint], tmp_path: Path):
    pyproject = _pyproject(tmp_path, "someone-else", {"lab": "lab.cli:lab_app"})
    assert declared_groups(pyproject=pyproject) == []


def test_this_checkout_declares_the_lab() -> None:
    assert "lab.cli:lab_app" in {e.value for e in declared_groups() if e.name == "lab"}


def test_a_found_group_runs_under_its_name() -> None:
    app = typer.Typer(name="mesh")
    add_command_groups(app, [EntryPoint(name="extra", value=f"{__name__}:extra_app", group=GROUP)])
    result = CliRunner().invoke(app, ["extra", "hello"])
    assert result.exit_code == 0, result.output
    assert result.output == "hello from extra\n"


def test_an_entry_point_that_is_not_a_typer_app_fails_loudly() -> None:
    app = typer.Typer(name="mesh")
    broken = EntryPoint(name="broken", value=f"{__name__}:not_a_typer", group=GROUP)
    with pytest.raises(TypeError, match=r"not a typer\.Typer"):
        add_command_groups(app, [broken])
