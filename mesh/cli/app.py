"""The root typer app and the helpers every command shares (home dir, error exit)."""

from __future__ import annotations

import os
from pathlib import Path

import typer
from rich.console import Console

app = typer.Typer(
    name="mesh",
    help="mlx-mesh: a peer-to-peer mesh of MLX LLM nodes.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
console = Console()
err_console = Console(stderr=True)

HomeOption = typer.Option(
    None, "--home", help="Home directory (default: $MLX_MESH_HOME, else ~/.mlx-mesh)."
)


def resolve_home(home: Path | None) -> Path:
    """--home, else $MLX_MESH_HOME, else ~/.mlx-mesh. The environment is read only here."""
    if home is not None:
        return home.expanduser().resolve()
    env = os.environ.get("MLX_MESH_HOME")
    if env:
        return Path(env).expanduser().resolve()
    return Path.home() / ".mlx-mesh"


def fail(message: str, code: int = 1) -> typer.Exit:
    """Print one clear sentence and return an Exit to raise: no tracebacks for user errors."""
    err_console.print(f"[bold red]error:[/] {message}")
    return typer.Exit(code)


def main() -> None:
    app()
