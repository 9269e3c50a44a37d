"""``mesh up``: start this node – the worker(s) and the gateway – and run until Ctrl-C."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from gateway.deadlines import FIRST_TOKEN_S, IDLE_S, StreamDeadlines
from mesh.cli.app import HomeOption, app, err_console, fail, read_secret, resolve_home
from mesh.cli.worker import (
    DISK_CACHE_OPTION_HELP,
    DRAFT_MODEL_OPTION_HELP,
    MEMORY_OPTION_HELP,
    PROMPT_CACHE_OPTION_HELP,
    SPECULATION_OPTION_HELP,
    check_worker_options,
)
from mesh.worker_health import HealthOptions

if TYPE_CHECKING:
    from mesh.copy.server import CopyConfig

DEFAULT_HEALTH = HealthOptions()


def allowed_host_names(host: str, advertise: list[str], extra: list[str]) -> frozenset[str]:
    """The names a browser may use for this gateway (the Host guard's list; IPs always pass)."""
    from gateway.config import LOOPBACK_NAMES, is_ip_literal

    machine = socket.gethostname().lower()
    names = {machine, f"{machine}.local", *(name.lower() for name in extra)}
    for address in [host, *(a.rpartition(":")[0] or a for a in advertise)]:
        if address and not is_ip_literal(address.strip("[]")):
            names.add(address.lower())
    return LOOPBACK_NAMES | names


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
        None,
        "--api-key",
        envvar="MLX_MESH_API_KEY",
        help="Require this key (Bearer or x-api-key); @FILE reads it from a file, - from stdin"
        " (keeps it out of the process list). At least 16 characters off loopback.",
    ),
    allowed_host: list[str] = typer.Option(
        [],
        "--allowed-host",
        help="Another name clients may call the gateway by (Host header); repeatable, * for any."
        " Loopback, IP addresses, --host and --advertise names and this machine's name are"
        " always allowed.",
    ),
    max_in_flight: int = typer.Option(
        64, "--max-in-flight", help="Concurrent requests before 429."
    ),
    request_log: Path | None = typer.Option(
        None,
        "--request-log",
        help="Append one JSON row per request here [default: HOME/requests.jsonl].",
    ),
    moa_policy: str = typer.Option(
        "auto",
        "--moa-policy",
        help="model=mesh arbiter: auto (the best model's one greedy answer for short-answer "
        "questions, race otherwise), race, consensus, reduce, vote, judge or single.",
    ),
    moa_workers: int = typer.Option(
        3, "--moa-workers", help="model=mesh: most worker calls per request."
    ),
    moa_progress: bool = typer.Option(
        False,
        "--moa-progress/--no-moa-progress",
        help="model=mesh: tell Responses clients 'asking N models…' as a reasoning summary.",
    ),
    join: str | None = typer.Option(
        None,
        "--join",
        help="Join the mesh of this invite token (from `mesh invite`); @FILE reads it from a"
        " file, - from stdin (keeps it out of the process list).",
    ),
    mesh_host: str = typer.Option(
        "0.0.0.0", "--mesh-host", help="Address for the mesh tunnel (QUIC, UDP)."
    ),
    mesh_port: int = typer.Option(9338, "--mesh-port", help="Mesh tunnel UDP port (0 = any)."),
    peer: list[str] = typer.Option(
        [], "--peer", help="HOST:PORT of a member's tunnel to always try; repeatable."
    ),
    advertise: list[str] = typer.Option(
        [], "--advertise", help="HOST:PORT peers should dial us at (default: derived); repeatable."
    ),
    no_discovery: bool = typer.Option(
        False, "--no-discovery", help="Do not advertise or browse on the LAN (mDNS)."
    ),
    copy_port: int | None = typer.Option(
        None,
        "--copy-port",
        help="TCP port of the peer-copy server (TLS, members only) [default: mesh port + 2;"
        " 0 = any; -1 = do not serve copies].",
    ),
    copy_rate: float | None = typer.Option(
        None, "--copy-rate", help="Most MB/s one member may copy from this node (default: no cap)."
    ),
    retry_backoff_ms: int = typer.Option(
        750, "--retry-backoff-ms", help="Wait before retrying a failed route (before first byte)."
    ),
    routing: str = typer.Option(
        "cache",
        "--routing",
        help="Where a request goes among the nodes serving its model: cache (its cached prefix"
        " against load and RTT), today (local first, then load/RTT/session hash), round-robin.",
    ),
    hedge: str = typer.Option(
        "off",
        "--hedge",
        help="auto: a forwarded request without a first token after the route's recent p95 TTFT"
        " also starts on the next-best idle node; the first to answer wins. off: never.",
    ),
    split: int = typer.Option(
        0,
        "--split",
        help="Serve each --model split layer-wise over N ranks (MLX distributed): on the members"
        " that offer the most memory (--share-memory there), the rest on this node.",
    ),
    split_over: str | None = typer.Option(
        None,
        "--split-over",
        help="Comma-separated node ids (or unique prefixes) to run the other ranks on, exactly;"
        " 'self' for one more rank here. Implies --split.",
    ),
    share_memory: float = typer.Option(
        0.0,
        "--share-memory",
        help="GB of memory this node offers to split ranks: members' and its own split's"
        " [default with --split: half of it, offered to its own ranks only].",
    ),
    speculation: str = typer.Option("auto", "--speculation", help=SPECULATION_OPTION_HELP),
    draft_model: str | None = typer.Option(None, "--draft-model", help=DRAFT_MODEL_OPTION_HELP),
    prompt_cache_gb: float = typer.Option(2.0, "--prompt-cache-gb", help=PROMPT_CACHE_OPTION_HELP),
    prompt_cache_disk_gb: float | None = typer.Option(
        None, "--prompt-cache-disk-gb", help=DISK_CACHE_OPTION_HELP
    ),
    memory_gb: float | None = typer.Option(None, "--memory-gb", help=MEMORY_OPTION_HELP),
    bridge_port: int | None = typer.Option(
        None,
        "--bridge-port",
        help="TCP port of the split ring bridge (TLS, members only) [default: mesh port + 3;"
        " 0 = any]. Runs on nodes that serve a model or offer memory.",
    ),
    first_token_timeout: float = typer.Option(
        FIRST_TOKEN_S,
        "--first-token-timeout",
        help="Seconds a local worker may take to its first token (queue and prefill included)"
        " before the request goes elsewhere or fails; 0 = no limit.",
    ),
    idle_token_timeout: float = typer.Option(
        IDLE_S,
        "--idle-token-timeout",
        help="Seconds a local worker's answer may pause between tokens before it ends in an"
        " error event; 0 = no limit.",
    ),
    worker_health_interval: float = typer.Option(
        DEFAULT_HEALTH.interval_s,
        "--worker-health-interval",
        help="Seconds between checks of each worker's /health (an answer must come within"
        " one); 0 = no checks.",
    ),
    worker_health_misses: int = typer.Option(
        DEFAULT_HEALTH.misses,
        "--worker-health-misses",
        help="Missed checks in a row that make a worker stuck: its model is withdrawn, the"
        " worker killed and restarted.",
    ),
    worker_stall_timeout: float = typer.Option(
        DEFAULT_HEALTH.stall_s,
        "--worker-stall-timeout",
        help="Seconds a worker's engine may spend in one step (a token or a prefill chunk)"
        " before its health checks count as missed.",
    ),
) -> None:
    """Start a node: one MLX worker per --model and the OpenAI/Anthropic gateway in front."""
    from gateway import __version__
    from gateway.config import GatewayConfig
    from gateway.moa.config import POLICIES, MoaConfig
    from mesh.errors import MeshError, NodeError
    from mesh.node import NodeConfig, run_mesh_node
    from mesh.service import MeshConfig
    from mesh.workers import SplitOptions
    from worker.serve.net import configure_logging

    health, deadlines = liveness_options(
        first_token_timeout,
        idle_token_timeout,
        worker_health_interval,
        worker_health_misses,
        worker_stall_timeout,
    )
    configure_logging()
    home_dir = resolve_home(home)
    api_key = read_secret(api_key, "API key")
    join = read_secret(join, "invite token")
    if moa_policy not in POLICIES:
        raise fail(f"unknown --moa-policy {moa_policy!r}; choose one of {', '.join(POLICIES)}")
    if moa_workers < 1:
        raise fail("--moa-workers must be at least 1")
    if split == 1 or split < 0:
        raise fail("--split takes the number of ranks, at least 2")
    if share_memory < 0:
        raise fail("--share-memory takes a size in GB")
    check_worker_options(speculation, prompt_cache_gb, prompt_cache_disk_gb, memory_gb)
    over = tuple(n.strip() for n in split_over.split(",") if n.strip()) if split_over else ()
    if split_over is not None and not over:
        raise fail("--split-over takes node ids (or 'self'), separated by commas")
    if over and split and split != len(over) + 1:
        raise fail(f"--split {split} and --split-over with {len(over)} node(s) disagree")
    splitting = bool(split or over)
    if draft_model and splitting:
        raise fail("--draft-model does not work with --split yet: rank 0 drafts by prompt lookup")
    models = tuple(model if no_worker else (_located(home_dir, name) for name in model))
    draft = _located(home_dir, draft_model) if draft_model and not no_worker else None
    if draft is not None:
        _check_draft(models, draft, draft_model)
    config = NodeConfig(
        home=home_dir,
        models=models,
        split=SplitOptions(
            ranks=split or len(over) + 1, share_memory_bytes=int(share_memory * 1e9), over=over
        )
        if splitting
        else None,
        host=host,
        port=port,
        start_workers=not no_worker,
        speculation=speculation,
        draft_model=draft,
        prompt_cache_gb=prompt_cache_gb,
        prompt_cache_disk_gb=prompt_cache_disk_gb,
        memory_gb=memory_gb,
        health=health,
        deadlines=deadlines,
        gateway=GatewayConfig(
            api_key=api_key,
            max_in_flight=max_in_flight,
            request_log=request_log or home_dir / "requests.jsonl",
            retry_backoff_ms=retry_backoff_ms,
            allowed_hosts=allowed_host_names(host, advertise, allowed_host),
        ),
        moa=MoaConfig(policy=moa_policy, max_workers=moa_workers, progress=moa_progress),
    )
    from mesh.routing.planner import HEDGE_MODES, MODES, RoutingConfig

    if routing not in MODES or hedge not in HEDGE_MODES:
        raise fail(f"--routing is one of {', '.join(MODES)}; --hedge one of {', '.join(HEDGE_MODES)}")  # fmt: skip
    mesh_config = MeshConfig(
        routing=RoutingConfig(mode=routing, hedge=hedge),
        host=mesh_host,
        port=mesh_port,
        static_peers=list(peer),
        advertise=list(advertise),
        join_token=join,
        discovery=not no_discovery,
        retry_backoff_s=retry_backoff_ms / 1000,
        version=__version__,
        copy=copy_config(mesh_host, mesh_port, copy_port, copy_rate),
        share_memory_bytes=int(share_memory * 1e9),
        # A node serving a model may have to split it (one too big for it, mesh/split/ranks.py)
        bridge=splitting or share_memory > 0 or (bool(model) and not no_worker),
        bridge_port=bridge_port if bridge_port is not None else (mesh_port + 3 if mesh_port else 0),
    )
    try:
        config.check()
        run_mesh_node(config, mesh_config)
    except (NodeError, MeshError) as exc:
        raise fail(str(exc)) from exc


def liveness_options(
    first_token_s: float, idle_s: float, interval_s: float, misses: int, stall_s: float
) -> tuple[HealthOptions, StreamDeadlines]:
    """The worker health checks and stream deadlines from ``mesh up``'s flags (0: off)."""
    if min(first_token_s, idle_s, interval_s) < 0 or stall_s <= 0:
        raise fail("the worker timeouts and the health interval take seconds (0: off)")
    if misses < 1:
        raise fail("--worker-health-misses takes a count, at least 1")
    health = HealthOptions(interval_s=interval_s, misses=misses, stall_s=stall_s)
    return health, StreamDeadlines(first_token_s or None, idle_s or None)


def _check_draft(models: tuple[str, ...], draft: str, name: str | None) -> None:
    """Refuse, in one sentence, a draft model whose vocabulary differs from a model's."""
    from worker.speculative.drafts import check_draft_dirs

    for model in models:
        if reason := check_draft_dirs(model, draft):
            raise fail(f"--draft-model {name} cannot draft for {model}: {reason}")


def _located(home: Path, name: str) -> str:
    """A store name missing from ``--home``'s store: the default store's copy, else pulled
    (with its progress bar); one line says which."""
    from mesh.cli.models import locate_store_model
    from mesh.cli.progress import RichProgress
    from worker.convert import ConvertError
    from worker.pull import PullError
    from worker.store import StoreError, pull_model

    def pull(model: str) -> Path:
        with RichProgress(err_console) as progress:
            return pull_model(home, model, progress)

    try:
        located, said = locate_store_model(home, resolve_home(None), name, pull)
    except (StoreError, PullError, ConvertError) as exc:
        raise fail(str(exc)) from exc
    if said:
        err_console.print(said, soft_wrap=True, highlight=False)
    return located


def copy_config(
    host: str, mesh_port: int, port: int | None, rate_mb: float | None
) -> CopyConfig | None:
    """The peer-copy server's settings from ``mesh up``'s options (None: serve no copies)."""
    from mesh.copy.server import CopyConfig

    if port is None:
        port = mesh_port + 2 if mesh_port else 0
    if port < 0:
        return None
    return CopyConfig(host=host, port=port, rate_bytes_per_s=rate_mb * 1e6 if rate_mb else None)
