"""``mesh up``: start this node – the worker(s) and the gateway – and run until Ctrl-C."""

from __future__ import annotations

from pathlib import Path

import typer

from mesh.cli.app import HomeOption, app, fail, resolve_home


@app.command("up")
def up_command(
    model: list[str] = typer.Option(
        [], "--model", help="Model to serve (store name or MLX directory); repeatable."
    ),
    host: str = typer.Option(
        "127.0.0.1", "--host", help="Gateway address (non-loopback needs --api-key)."
    ),
    port: int = typer.Option(9337, "--port", help="Gateway port (0 = any free port)."),
    home: Path | None = HomeOption,
    no_worker: bool = typer.Option(
        False, "--no-worker", help="Run the gateway only (no local model)."
    ),
    api_key: str | None = typer.Option(
        None, "--api-key", envvar="MLX_MESH_API_KEY", help="Require this key (Bearer or x-api-key)."
    ),
    max_in_flight: int = typer.Option(
        64, "--max-in-flight", help="Concurrent requests before 429."
    ),
    request_log: Path | None = typer.Option(
        None, "--request-log", help="Append one JSON row per request here."
    ),
) -> None:
    """Start a node: one MLX worker per --model and the OpenAI/Anthropic gateway in front."""
    from gateway.config import GatewayConfig
    from mesh.node import NodeConfig, NodeError, run_node

    home_dir = resolve_home(home)
    config = NodeConfig(
        home=home_dir,
        models=tuple(model),
        host=host,
        port=port,
        start_workers=not no_worker,
        gateway=GatewayConfig(
            api_key=api_key, max_in_flight=max_in_flight, request_log=request_log
        ),
    )
    try:
        config.check()
        run_node(config)
    except NodeError as exc:
        raise fail(str(exc)) from exc
