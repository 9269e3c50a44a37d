"""The root typer app and the helpers every command shares (home dir, error exit)."""

from __future__ import annotations

import os
import sys
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


def read_secret(value: str | None, what: str) -> str | None:
    """A secret given as itself, as ``@FILE`` (read from that file) or ``-`` (read from stdin):
    the last two keep it out of the process list. Surrounding whitespace is dropped."""
    if value is None:
        return None
    if value == "-":
        text = sys.stdin.readline()
    elif value.startswith("@"):
        path = Path(value[1:]).expanduser()
        try:
            text = path.read_text()
        except OSError as exc:
            raise fail(f"cannot read the {what} from {path}: {exc.strerror}") from None
    else:
        text = value
    return text.strip()


def main() -> None:
    app()
