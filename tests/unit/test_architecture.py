"""The tree's shape, walked from the source: no import circle, imports only go
``mesh → gateway → worker``. Every import counts, a function's lazy one too (it is a
dependency all the same); only ``if TYPE_CHECKING:`` blocks are left out. And no production
module grows past ``MAX_LINES``: a longer one is split where its responsibilities part."""

from __future__ import annotations

import ast
from collections.abc import Collection
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("worker", "gateway", "mesh", "lab")
# Who may import whom at module level: the layers go one way; lab is a tool beside the mesh.
ALLOWED = {
    "worker": {"worker"},
    "gateway": {"gateway", "worker"},
    "mesh": {"mesh", "gateway", "worker"},
    "lab": {"lab", "mesh", "gateway", "worker"},
}
# The design's one exception: `mesh lab ...` runs the lab, importing it inside its commands.
CLI_MAY_IMPORT = {"lab"}
MAX_LINES = 500
# Every production package is held to MAX_LINES: past it, a module is asking to be split.
PACKAGES_CHECKED_FOR_LENGTH = PACKAGES


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {
        _module_name(path): path
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
    }


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.Module, module: str, is_package: bool, modules: Collection[str]) -> set[str]:
    """Modules a module imports anywhere in its body, but for ``if TYPE_CHECKING:`` blocks."""
    found: set[str] = set()
    todo: list[ast.AST] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            todo.extend(node.orelse)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            # `from pkg import submodule` imports the submodule; anything else, the module
            found.update(
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                for alias in node.names
            )
        else:
            todo.extend(ast.iter_child_nodes(node))
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        imported = _imports(tree, name, path.name == "__init__.py", modules)
        graph[name] = {target for target in imported if target in modules and target != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_module_level_import_circle():
    assert _cycles(_graph()) == []


def test_imports_only_go_down_the_layers():
    upward = [
        f"{source} imports {target}"
        for source, targets in _graph().items()
        for target in targets
        if target.split(".")[0] not in ALLOWED[source.split(".")[0]]
        and not (source.startswith("mesh.cli.") and target.split(".")[0] in CLI_MAY_IMPORT)
    ]
    assert upward == []


def test_the_walk_sees_a_circle_and_an_upward_import():
    """The checks above can fail: a made-up graph with both is caught."""
    graph = {"worker.a": {"worker.b"}, "worker.b": {"worker.a", "gateway.x"}, "gateway.x": set()}
    assert _cycles(graph) == [["worker.a", "worker.b"]]
    module = ast.parse("from ..x import y\nif TYPE_CHECKING:\n    import mesh.z\n")
    found = _imports(module, "gateway.api.m", False, {"gateway.x", "gateway.x.y"})
    assert found == {"gateway.x.y"}


def _too_long(paths: Collection[Path], root: Path = ROOT) -> list[str]:
    lengths = {path: len(path.read_text(encoding="utf-8").splitlines()) for path in paths}
    return [f"{path.relative_to(root)}: {n} lines" for path, n in lengths.items() if n > MAX_LINES]


def test_no_production_module_is_over_max_lines():
    paths = [
        path
        for name, path in _modules().items()
        if name.split(".")[0] in PACKAGES_CHECKED_FOR_LENGTH
    ]
    assert paths, "no module found to measure"
    assert _too_long(paths) == []


def test_the_length_check_sees_a_long_module(tmp_path: Path) -> None:
    """The check above can fail: a made-up module one line too long is caught."""
    (tmp_path / "long.py").write_text("x = 1\n" * (MAX_LINES + 1), encoding="utf-8")
    (tmp_path / "short.py").write_text("x = 1\n" * MAX_LINES, encoding="utf-8")
    found = _too_long(sorted(tmp_path.glob("*.py")), root=tmp_path)
    assert found == [f"long.py: {MAX_LINES + 1} lines"]
