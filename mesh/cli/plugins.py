"""Command groups other packages add to ``mesh``, found by entry point instead of imported by
name: ``mesh lab`` is the lab's (``lab/cli.py``), and mesh/ never imports lab/.

A package declares its groups in its ``pyproject.toml``::

    [project.entry-points."mlx_mesh.commands"]
    lab = "lab.cli:lab_app"          # a typer.Typer, added as `mesh lab`

Installing copies that into the package's metadata, where :func:`declared_groups` finds it. A
checkout that runs without installing (``PYTHONPATH``, or an editable install made before the
declaration was added) has no such metadata: for it the declaration is read from the
checkout's own ``pyproject.toml``, which is what installing would have copied.
"""

from __future__ import annotations

import tomllib
from collections.abc import Iterable
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path

import typer

GROUP = "mlx_mesh.commands"
DISTRIBUTION = "mlx-mesh"
# Beside the mesh package in a checkout; site-packages has no pyproject.toml.
CHECKOUT_PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def declared_groups(group: str = GROUP, pyproject: Path = CHECKOUT_PYPROJECT) -> list[EntryPoint]:
    """The command groups installed packages declare, and the checkout's ``pyproject.toml``
    (its own win a name both declare: that is the code this process runs), by name."""
    found = {entry.name: entry for entry in entry_points(group=group)}
    found |= {entry.name: entry for entry in _from_pyproject(pyproject, group)}
    return sorted(found.values(), key=lambda entry: entry.name)


def add_command_groups(app: typer.Typer, groups: Iterable[EntryPoint]) -> None:
    """Add each group's ``typer.Typer`` to ``app`` under the entry point's name. A group that
    cannot load fails the whole command line: it is one of ours, and broken."""
    for entry in groups:
        sub_app = entry.load()
        if not isinstance(sub_app, typer.Typer):
            raise TypeError(f"{entry.value} ({GROUP} {entry.name}) is not a typer.Typer")
        app.add_typer(sub_app, name=entry.name)


def _from_pyproject(path: Path, group: str) -> list[EntryPoint]:
    try:
        project = tomllib.loads(path.read_text(encoding="utf-8")).get("project", {})
    except FileNotFoundError:
        return []
    if project.get("name") != DISTRIBUTION:
        return []  # some other project's file
    declared = project.get("entry-points", {}).get(group, {})
    return [EntryPoint(name=name, value=value, group=group) for name, value in declared.items()]
