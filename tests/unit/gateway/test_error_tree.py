"""gateway/errors.py draws the tree of ``GatewayError`` subclasses: every subclass defined in
gateway/ is drawn there, and nothing drawn there is gone."""

from __future__ import annotations

import importlib
import pkgutil
import re

import gateway
import gateway.errors
from gateway.errors import GatewayError
from gateway.refusals import RequestInvalid

# A leaf of the drawn tree: ``├── Name`` or ``└── Name``, at any depth.
_LEAF = re.compile(r"[├└]── (\w+)")


def _import_gateway() -> None:
    """Every gateway module: a subclass exists only once its module is imported."""
    for module in pkgutil.walk_packages(gateway.__path__, "gateway."):
        importlib.import_module(module.name)


def _subclasses(root: type) -> set[type]:
    found: set[type] = set()
    for cls in root.__subclasses__():
        found |= {cls, *_subclasses(cls)}
    return found


def _in_gateway(cls: type) -> bool:
    # Left out: subclasses defined by tests (the made-up one below among them).
    return cls.__module__.split(".")[0] == "gateway"


def _mismatch(defined: set[str], docstring: str) -> tuple[list[str], list[str]]:
    """(subclasses the tree misses, names the tree draws that are no subclass)."""
    drawn = set(_LEAF.findall(docstring))
    return sorted(defined - drawn), sorted(drawn - defined)


def test_every_gateway_error_is_drawn_in_the_tree():
    _import_gateway()
    defined = {cls.__name__ for cls in _subclasses(GatewayError) if _in_gateway(cls)}
    assert {"RequestInvalid", "ResponseStateError", "RouteError"} <= defined  # the walk works
    assert _mismatch(defined, gateway.errors.__doc__ or "") == ([], [])


def test_the_check_sees_a_missing_leaf_and_a_stale_one():
    """The check above can fail: a made-up subclass is reported missing, and a drawn name that
    is no subclass is reported stale."""

    class MadeUpError(RequestInvalid):
        pass

    _import_gateway()
    defined = {
        cls.__name__ for cls in _subclasses(GatewayError) if _in_gateway(cls) or cls is MadeUpError
    }
    docstring = (gateway.errors.__doc__ or "") + "    └── GoneError   removed long ago\n"
    assert _mismatch(defined, docstring) == (["MadeUpError"], ["GoneError"])
