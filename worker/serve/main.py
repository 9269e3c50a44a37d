"""``python -m worker --model X [--host H] [--port N] [--home DIR] [--name NAME]``.

The node supervisor starts the worker as a child process with this command line; it prints
``worker listening on URL (model NAME)`` once the model is loaded, warmed up (one short
generation, so that the first request does not wait for MLX to compile its kernels;
``--no-warm-up`` skips it) and the port is bound. The node passes the worker's secret in
``$MLX_MESH_WORKER_SECRET`` (never on the command line, which every local user can read); then
every request must carry it.
On Linux's CPU backend the process first restarts itself once with OpenBLAS preloaded when
that is installed (worker/cpu/fast_path.py; ``--no-fast-blas`` or ``MLX_MESH_BLAS=off`` to not).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import NoReturn

from worker.cpu.allocator import return_freed_memory
from worker.cpu.fast_path import DEFAULT_DEQUANTIZE_SHARE, reexec_with_fast_blas
from worker.engine.core import Engine, EngineError
from worker.engine.loop_guard import configured_span
from worker.engine.types import DRAFT_MODEL_HELP, SPECULATION_HELP, SPECULATION_MODES, EngineConfig
from worker.prompt_cache.disk import DiskTierConfig, model_fingerprint
from worker.serve.net import SECRET_ENV, configure_logging
from worker.speculative.drafts import check_draft_dirs
from worker.speculative.policy import Speculation

DEFAULT_DISK_MAX_BYTES = 16 << 30


def store_root(home: Path | None) -> Path:
    return home if home is not None else Path.home() / ".mlx-mesh"


def locate_model(model: str, home: Path | None) -> str:
    """A store name → its directory; a local directory → itself; else a hub id, unchanged.

    Never downloads: a registry model that is not pulled yet is an error naming the fix.
    """
    from worker import store

    candidate = Path(model).expanduser()
    if model.startswith(("/", ".", "~")) and not candidate.is_dir():
        raise LookupError(f"no model directory at {candidate}")
    resolved = store.resolve_model(store_root(home), model)
    if resolved == model and model in store.REGISTRY:
        raise LookupError(f"model {model!r} is not pulled yet: run `mesh models pull {model}`")
    return resolved


def disk_tier_config(
    home: Path, served_name: str, model_path: str, gb: float | None
) -> DiskTierConfig | None:
    """Where and how much of the prompt cache's disk tier: ``<home>/cache/<model>/``, ``gb``
    (None: a tenth of the free disk, 16 GB at most; 0: no disk tier)."""
    directory = home / "cache" / served_name.replace("/", "--")
    if gb is None:
        directory.parent.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(directory.parent).free
        max_bytes = min(free // 10, DEFAULT_DISK_MAX_BYTES)
    else:
        max_bytes = int(gb * (1 << 30))
    if max_bytes <= 0:
        return None
    return DiskTierConfig(str(directory), max_bytes, model_fingerprint(model_path))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m worker", description=__doc__)
    parser.add_argument("--model", required=True, help="store name, MLX directory or hub id")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9339)
    parser.add_argument("--home", type=Path, default=None, help="mlx-mesh home (model store)")
    parser.add_argument("--name", default=None, help="model name to serve as (default: --model)")
    parser.add_argument("--prompt-cache-gb", type=float, default=2.0)
    parser.add_argument(
        "--memory-gb",
        type=float,
        default=None,
        help="one memory budget for running KV, pending commits and the prompt cache's memory"
        " tier (0: none; default 80%% of physical memory less the weights)",
    )
    parser.add_argument(
        "--prompt-cache-disk-gb",
        type=float,
        default=None,
        help="prompt caches kept on disk across restarts, in <home>/cache/<model>/ (0: none;"
        " default a tenth of the free disk, 16 at most)",
    )
    parser.add_argument(
        "--no-fast-blas",
        dest="fast_blas",
        action="store_false",
        help="do not restart with OpenBLAS preloaded (Linux CPU backend)",
    )
    parser.add_argument(
        "--cpu-dequantize-share",
        type=float,
        default=DEFAULT_DEQUANTIZE_SHARE,
        help="on the CPU, run quantized weights as float32 when that takes at most this share "
        "of physical memory (0: keep them quantized)",
    )
    parser.add_argument(
        "--loop-guard",
        type=int,
        default=None,
        metavar="TOKENS",
        help="end an answer whose last TOKENS tokens are one block repeated (0: off; default $MLX_MESH_LOOP_GUARD, else 256)",
    )
    parser.add_argument(
        "--speculation",
        choices=SPECULATION_MODES,
        default="auto",
        help=SPECULATION_HELP,
    )
    parser.add_argument("--draft-model", default=None, help=DRAFT_MODEL_HELP)
    parser.add_argument(
        "--no-warm-up",
        dest="warm_up",
        action="store_false",
        help="announce the worker without a warm-up generation (the first request is slower)",
    )
    return parser


def run(
    model: str,
    *,
    host: str = "127.0.0.1",
    port: int = 9339,
    home: Path | None = None,
    name: str | None = None,
    prompt_cache_gb: float = 2.0,
    prompt_cache_disk_gb: float | None = None,
    memory_gb: float | None = None,
    secret: str | None = None,
    fast_blas: bool = True,
    cpu_dequantize_share: float = DEFAULT_DEQUANTIZE_SHARE,
    warm_up: bool = True,
    loop_guard: int | None = None,
    speculation: str = "auto",
    draft_model: str | None = None,
) -> None:
    """Load the model, warm it up and serve it until interrupted (raises EngineError if it
    cannot load).

    This is a process entry point: with ``fast_blas`` it may first re-execute the process
    (same pid and arguments) with OpenBLAS preloaded, see ``worker.cpu.fast_path.reexec_with_fast_blas``.
    """
    from worker import store
    from worker.serve.app import serve

    if fast_blas:
        reexec_with_fast_blas()
    return_freed_memory()  # before the engine's threads make their malloc arenas
    path = locate_model(model, home)
    draft_path = locate_model(draft_model, home) if draft_model else None
    if draft_path is not None and (reason := check_draft_dirs(path, draft_path)):
        raise EngineError(f"--draft-model {draft_model} refused: {reason}")
    served_name = name or (Path(model).name if Path(model).expanduser().is_dir() else model)
    config = EngineConfig(
        prompt_cache_bytes=int(prompt_cache_gb * (1 << 30)),
        memory_budget_bytes=None if memory_gb is None else int(memory_gb * (1 << 30)),
        prompt_cache_disk=disk_tier_config(
            store_root(home), served_name, path, prompt_cache_disk_gb
        ),
        cpu_dequantize_share=cpu_dequantize_share,
        loop_guard_tokens=configured_span() if loop_guard is None else loop_guard,
        speculation=Speculation(mode=speculation),
        draft_model=draft_path,
    )
    engine = Engine(
        path,
        name=served_name,
        config=config,
        generation_config_fallback=store.registry_generation_config(store_root(home), model),
    )
    engine.start()
    try:
        serve(engine, host, port, secret=secret, warm_up=warm_up)
    finally:
        engine.close()


def exit_process(code: int) -> NoReturn:
    """Exit at once, without the interpreter's teardown. After a clean shutdown MLX's stream
    threads can still be joinable when native static destructors run, and that aborts the
    process ("terminate called without an active exception", status 134)."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.fast_blas:
        # Before the secret is popped from the environment: the restarted process needs it.
        reexec_with_fast_blas()
    configure_logging()
    try:
        run(
            args.model,
            host=args.host,
            port=args.port,
            home=args.home,
            name=args.name,
            prompt_cache_gb=args.prompt_cache_gb,
            prompt_cache_disk_gb=args.prompt_cache_disk_gb,
            memory_gb=args.memory_gb,
            secret=os.environ.pop(SECRET_ENV, None) or None,
            fast_blas=False,  # done above
            cpu_dequantize_share=args.cpu_dequantize_share,
            warm_up=args.warm_up,
            loop_guard=args.loop_guard,
            speculation=args.speculation,
            draft_model=args.draft_model,
        )
    except (EngineError, OSError, LookupError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    return 0
