"""``mesh lab``: the probe and the fault lab from the mesh command line.

``mesh lab probe`` measures a running gateway (this node's by default) through every client API;
``mesh lab run SCENARIO`` runs a fault scenario on a throw-away local mesh. The mesh command line
finds :data:`lab_app` through the ``mlx_mesh.commands`` entry point (``mesh/cli/plugins.py``),
so mesh/ never imports lab/.

The commands import the rest of the lab, and mesh's CLI helpers, inside their bodies: loading
this module (every ``mesh`` run does) costs only typer. And it must not import ``mesh.cli`` as it
loads: ``mesh.cli`` loads this module while itself loading, so an ``import lab.cli`` that came
first would meet itself half-loaded there.
"""

from __future__ import annotations

from pathlib import Path

import typer

lab_app = typer.Typer(
    name="lab",
    help="Probe a live gateway; run fault scenarios on a local test mesh.",
    no_args_is_help=True,
)
# mesh.cli.app's HomeOption, which this module cannot import at load time (see above).
HomeOption = typer.Option(
    None, "--home", help="Home directory (default: $MLX_MESH_HOME, else ~/.mlx-mesh)."
)


def _split(text: str | None) -> list[str] | None:
    if text is None:
        return None
    return [part.strip() for part in text.split(",") if part.strip()]


@lab_app.command("probe")
def probe_command(
    url: str | None = typer.Option(
        None, "--url", help="Gateway URL (default: this node's, from <home>/node.json)."
    ),
    home: Path | None = HomeOption,
    models: str | None = typer.Option(
        None, "--models", help="Comma-separated model ids (default: every listed model + mesh)."
    ),
    apis: str = typer.Option("chat,responses,messages", "--apis", help="APIs to probe through."),
    interval: float = typer.Option(5.0, "--interval", help="Seconds between round starts."),
    duration: float | None = typer.Option(None, "--duration", help="Stop after this many seconds."),
    count: int | None = typer.Option(None, "--count", help="Stop after this many rounds."),
    out: Path | None = typer.Option(None, "--out", help="Output directory."),
    ab: str | None = typer.Option(None, "--ab", help="Second gateway URL: interleave, b/a ratios."),
    api_key: str | None = typer.Option(None, "--api-key", envvar="MLX_MESH_API_KEY"),
    timeout: float = typer.Option(60.0, "--timeout", help="Hard per-request deadline (s)."),
    max_tokens: int = typer.Option(24, "--max-tokens"),
    no_sentinel: bool = typer.Option(False, "--no-sentinel", help="Skip the one-word check."),
    no_mesh: bool = typer.Option(False, "--no-mesh", help='Do not add model "mesh".'),
) -> None:
    """Probe a gateway: sentinel + streamed request per model and API; rows, summary, plots.

    Exits 1 when any stream hung (never terminated before the deadline).
    """
    from lab.probe import ProbeConfig, run_probe_cli
    from lab.rows import API_NAMES
    from mesh.cli.app import fail, resolve_home

    if duration is not None and count is not None:
        raise fail("give --duration or --count, not both")
    api_list = _split(apis) or []
    unknown = sorted(set(api_list) - set(API_NAMES))
    if unknown or not api_list:
        raise fail(f"unknown api {', '.join(unknown) or '(none)'}: use {', '.join(API_NAMES)}")
    if url is None:
        from mesh.cli.chat import ChatError, find_node

        try:
            node = find_node(resolve_home(home))
        except ChatError as exc:
            raise fail(str(exc)) from exc
        url, api_key = node.url, api_key or node.api_key
    config = ProbeConfig(
        urls=[url, *([ab] if ab else [])],
        models=_split(models),
        apis=api_list,  # type: ignore[arg-type]  # checked against API_NAMES above
        interval_s=interval,
        duration_s=duration,
        count=count,
        out_dir=out,
        api_key=api_key,
        timeout_s=timeout,
        max_tokens=max_tokens,
        sentinel=not no_sentinel,
        include_mesh=not no_mesh,
    )
    raise typer.Exit(run_probe_cli(config))


@lab_app.command("run")
def run_command(
    scenario: str = typer.Argument(..., help="A TOML file, or a name in lab/scenarios/."),
    out: Path | None = typer.Option(None, "--out", help="Output directory (default: temp dir)."),
    model: str | None = typer.Option(
        None, "--model", help="Serve this real model on every node instead of tiny test models."
    ),
    seed: int = typer.Option(1, "--seed", help="Chaos proxies' random seed (replayable runs)."),
) -> None:
    """Run a fault scenario on local nodes behind chaos proxies and print its verdict.

    Exit status: 0 pass, 1 fail (hung requests, no recovery, …), 2 the lab could not run.
    """
    from lab.netlab import run_scenario_cli

    raise typer.Exit(run_scenario_cli(scenario, out_dir=out, model=model, seed=seed))


@lab_app.command("suite")
def suite_command(
    scenarios: list[str] = typer.Argument(None, help="Scenarios (default: every bundled one)."),
    out: Path = typer.Option(..., "--out", help="Output directory (one folder per scenario)."),
    markdown: Path | None = typer.Option(None, "--markdown", help="Also write the table here."),
) -> None:
    """Run several scenarios in turn and print one markdown table of their verdicts."""
    from lab.suite import main as suite_main

    argv = [*(scenarios or []), "--out", str(out)]
    if markdown is not None:
        argv += ["--markdown", str(markdown)]
    raise typer.Exit(suite_main(argv))


@lab_app.command("scenarios")
def scenarios_command() -> None:
    """List the bundled scenarios."""
    from lab.scenario import SCENARIO_DIR, load_scenario

    for path in sorted(SCENARIO_DIR.glob("*.toml")):
        typer.echo(f"{path.stem:18} {load_scenario(path).description}")
