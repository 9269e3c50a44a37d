"""mesh/errors.py draws the MeshError tree in its docstring: every subclass of ``MeshError``
defined anywhere in mesh/ is named there, so the drawing cannot fall behind the code."""

from __future__ import annotations

import importlib
import pkgutil
import re
from collections.abc import Iterable

import mesh
from mesh import errors
from mesh.errors import CopyError, MeshError, TunnelError


def _import_every_mesh_module() -> None:
    def fail(name: str) -> None:
        raise ImportError(f"cannot import {name}")

    for module in pkgutil.walk_packages(mesh.__path__, "mesh.", onerror=fail):
        importlib.import_module(module.name)


def _subclasses(root: type) -> set[type]:
    found: set[type] = set()
    todo = [root]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in found:
                found.add(sub)
                todo.append(sub)
    return found


def _missing_from_tree(classes: Iterable[type], tree: str) -> list[str]:
    """The classes whose name the drawing does not mention, as module.qualname."""
    return sorted(
        f"{cls.__module__}.{cls.__qualname__}"
        for cls in classes
        if not re.search(rf"\b{re.escape(cls.__name__)}\b", tree)
    )


def test_every_mesh_error_is_drawn_in_the_tree() -> None:
    _import_every_mesh_module()
    # Only mesh's own: a test may define a subclass of its own (the one below does).
    drawn = {cls for cls in _subclasses(MeshError) if cls.__module__.split(".")[0] == "mesh"}
    assert {CopyError, TunnelError} <= drawn  # the walk found the tree at all
    assert _missing_from_tree(drawn, errors.__doc__ or "") == []


def test_the_check_sees_an_error_left_out_of_the_tree() -> None:
    """The check above can fail: a made-up subclass is reported, the drawn ones are not."""

    class MadeUpError(CopyError):
        pass

    found = _missing_from_tree({MadeUpError, CopyError, TunnelError}, errors.__doc__ or "")
    assert found == [f"{__name__}.{MadeUpError.__qualname__}"]
