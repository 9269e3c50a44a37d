"""The tree's shape, walked from the source: no import circle (also counting ``if
TYPE_CHECKING:`` imports), imports only go ``mesh → gateway → worker``, and inside ``worker/``
its rooms import down their floors, as a request travels. Every import counts, a function's
lazy one too (it is a dependency all the same). No production module grows past
``MAX_LINES``: a longer one is split where its responsibilities part, and a cut makes a
collaborator that owns its state – no mixin (a base class of ours that only declares the state
its subclass provides), no ``TYPE_CHECKING`` block inside a class body."""

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


def _imports(
    tree: ast.Module,
    module: str,
    is_package: bool,
    modules: Collection[str],
    type_checking: bool = False,
) -> set[str]:
    """Modules a module imports anywhere in its body; ``if TYPE_CHECKING:`` blocks only with
    ``type_checking``."""
    found: set[str] = set()
    todo: list[ast.AST] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and _is_type_checking(node) and not type_checking:
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


def _graph(type_checking: bool = False) -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        imported = _imports(tree, name, path.name == "__init__.py", modules, type_checking)
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


def test_no_import_circle_even_counting_type_checking_imports():
    """A circle of type-only imports is a circle of knowledge all the same."""
    assert _cycles(_graph(type_checking=True)) == []


def test_imports_only_go_down_the_layers():
    """No exception: ``mesh lab`` finds the lab through an entry point (mesh/cli/plugins.py)."""
    upward = [
        f"{source} imports {target}"
        for source, targets in _graph(type_checking=True).items()
        for target in targets
        if target.split(".")[0] not in ALLOWED[source.split(".")[0]]
    ]
    assert upward == []


def test_the_walk_sees_a_circle_and_an_upward_import():
    """The checks above can fail: a made-up graph with both is caught."""
    graph = {"worker.a": {"worker.b"}, "worker.b": {"worker.a", "gateway.x"}, "gateway.x": set()}
    assert _cycles(graph) == [["worker.a", "worker.b"]]
    module = ast.parse("from ..x import y\nif TYPE_CHECKING:\n    import mesh.z\n")
    found = _imports(module, "gateway.api.m", False, {"gateway.x", "gateway.x.y"})
    assert found == {"gateway.x.y"}
    found = _imports(module, "gateway.api.m", False, {"gateway.x.y", "mesh.z"}, True)
    assert found == {"gateway.x.y", "mesh.z"}


# ---- worker/: rooms a request travels through, top-down -----------------------------------------

# Each entry a floor; a module imports its own room or rooms on floors below (flat modules are
# rooms of one). serve is the process; chat turns a request into a job; the engine runs jobs
# on the model; its parts below; the store and the seam onto mlx-lm at the ground.
WORKER_FLOORS: tuple[frozenset[str], ...] = (
    frozenset({"__main__", "testing"}),
    frozenset({"serve"}),
    frozenset({"store"}),
    frozenset({"pull"}),
    frozenset({"chat"}),
    frozenset({"engine"}),
    frozenset({"speculative", "prompt_cache", "cpu", "tools", "convert"}),
    frozenset({"split", "structured"}),
    frozenset({"sampling", "generation_config", "mlx_lm_hooks"}),
)
MAX_FLAT_WORKER_MODULES = 8


def _room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "worker" and len(parts) > 1 else None


def _downward_in_worker(graph: dict[str, set[str]]) -> list[str]:
    floor = {room: level for level, rooms in enumerate(WORKER_FLOORS) for room in rooms}
    found = []
    for source, targets in graph.items():
        mine = _room(source)
        if mine is None:
            continue
        for target in targets:
            theirs = _room(target)
            if theirs is None or theirs == mine:
                continue
            if mine not in floor or theirs not in floor:
                found.append(f"{source} imports {target}: a room on no floor (WORKER_FLOORS)")
            elif floor[theirs] <= floor[mine]:
                found.append(f"{source} imports {target}: up or across the worker's floors")
    return found


def test_worker_rooms_import_down_their_floors():
    assert _downward_in_worker(_graph(type_checking=True)) == []


def test_the_floor_check_sees_an_upward_import():
    graph = {"worker.engine.core": {"worker.chat.prompt"}, "worker.chat.job": {"worker.engine"}}
    assert _downward_in_worker(graph) == [
        "worker.engine.core imports worker.chat.prompt: up or across the worker's floors"
    ]


def test_the_engine_takes_token_ids():
    """Rendering a conversation is the chat room's: the engine imports no chat-template or
    tool module."""
    rendering = [
        f"{source} imports {target}"
        for source, targets in _graph(type_checking=True).items()
        if source.startswith("worker.engine")
        for target in targets
        if target.startswith(("worker.chat", "worker.tools"))
    ]
    assert rendering == []


def test_few_modules_stay_flat_in_worker():
    flat = sorted(p.name for p in (ROOT / "worker").glob("*.py"))
    assert len(flat) <= MAX_FLAT_WORKER_MODULES, flat


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


# ---- a cut makes a collaborator, not a mixin -----------------------------------------------------

# Bases that say what a class is, not where its state lives: errors, schemas, interfaces.
_KIND_BASES = ("Exception", "Error", "BaseModel", "Protocol", "TypedDict", "NamedTuple", "Enum")


def _class_bodies(paths: Collection[Path]) -> dict[str, list[tuple[Path, ast.ClassDef]]]:
    found: dict[str, list[tuple[Path, ast.ClassDef]]] = {}
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.ClassDef):
                found.setdefault(node.name, []).append((path, node))
    return found


def _declares_without_owning(node: ast.ClassDef) -> bool:
    """A class that declares instance state (``name: T``, no value) it never sets: it has no
    ``__init__``, is no dataclass and says of no kind that sets it (``_KIND_BASES``)."""
    decorators = [ast.unparse(d) for d in node.decorator_list]
    bases = [ast.unparse(b) for b in node.bases]
    if any("dataclass" in d for d in decorators) or any(
        b.endswith(kind) for b in bases for kind in _KIND_BASES
    ):
        return False
    body = node.body
    has_init = any(isinstance(s, ast.FunctionDef) and s.name == "__init__" for s in body)
    declared = [s for s in body if isinstance(s, ast.AnnAssign) and s.value is None]
    return bool(declared) and not has_init


def _mixins(paths: Collection[Path], root: Path = ROOT) -> list[str]:
    """Classes of ours inherited from that only declare the state their subclass provides, and
    classes with a ``TYPE_CHECKING`` block in their body (declaring another's private state)."""
    classes = _class_bodies(paths)
    found = []
    for name, defs in classes.items():
        for path, node in defs:
            where = f"{path.relative_to(root)}: {name}"
            if any(isinstance(s, ast.If) and _is_type_checking(s) for s in node.body):
                found.append(f"{where} has a TYPE_CHECKING block in its body")
            for base in node.bases:
                base_name = ast.unparse(base).split(".")[-1].split("[")[0]
                for base_path, base_node in classes.get(base_name, []):
                    if _declares_without_owning(base_node):
                        found.append(
                            f"{where} inherits the state {base_name} only declares"
                            f" ({base_path.relative_to(root)})"
                        )
    return sorted(set(found))


def test_no_mixins_and_no_type_checking_in_class_bodies():
    assert _mixins(list(_modules().values())) == []


def test_the_mixin_check_sees_a_mixin(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text(
        "class Half:\n    rows: dict\n    def step(self):\n        return self.rows\n\n"
        "class Whole(Half):\n    if TYPE_CHECKING:\n        def go(self): ...\n"
        "    def __init__(self):\n        self.rows = {}\n",
        encoding="utf-8",
    )
    assert _mixins([tmp_path / "m.py"], root=tmp_path) == [
        "m.py: Whole has a TYPE_CHECKING block in its body",
        "m.py: Whole inherits the state Half only declares (m.py)",
    ]
