"""``mesh worker``: serve one model with the MLX worker (OpenAI chat completions on loopback)."""

from __future__ import annotations

from pathlib import Path

import typer

from mesh.cli.app import HomeOption, app, fail, resolve_home

SPECULATION_OPTION_HELP = (
    "Speculative decoding: auto drafts from each request's prompt and answer and checks the"
    " drafts in one forward pass (per request while they are accepted); off: a token a step."
)
PROMPT_CACHE_OPTION_HELP = (
    "GB of memory each worker keeps for cached prompt prefixes (KV), reused by later turns that"
    " share them; 0 turns the cache off."
)
DRAFT_MODEL_OPTION_HELP = (
    "A small model of the same tokenizer (store name or MLX directory) that drafts the tokens"
    " speculation checks, instead of the request's own prompt (e.g. qwen3-0.6b for qwen3-8b)."
)


DISK_CACHE_OPTION_HELP = (
    "GB of prompt caches each worker keeps on disk across restarts, in <home>/cache/<model>/"
    " (0: none) [default: a tenth of the free disk, 16 at most]."
)
MEMORY_OPTION_HELP = (
    "GB of one memory budget per worker for running requests and prompt caches: past it a"
    " request waits, or gets 429 + Retry-After (0: none) [default: 80% of memory less the"
    " weights]."
)


def check_worker_options(
    speculation: str,
    prompt_cache_gb: float,
    prompt_cache_disk_gb: float | None = None,
    memory_gb: float | None = None,
) -> None:
    """Refuse, in words, worker settings ``mesh up`` and ``mesh worker`` share."""
    if speculation not in ("auto", "off"):
        raise fail(f"--speculation is auto or off, not {speculation!r}")
    if prompt_cache_gb < 0:
        raise fail("--prompt-cache-gb takes a size in GB (0: no prompt cache)")
    if prompt_cache_disk_gb is not None and prompt_cache_disk_gb < 0:
        raise fail("--prompt-cache-disk-gb takes a size in GB (0: no disk tier)")
    if memory_gb is not None and memory_gb < 0:
        raise fail("--memory-gb takes a size in GB (0: no memory budget)")


@app.command("worker")
def worker_command(
    model: str = typer.Option(..., "--model", help="Model: store name, MLX directory or hub id."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
    port: int = typer.Option(9339, "--port", help="Port to listen on (0 = any free port)."),
    home: Path | None = HomeOption,
    name: str | None = typer.Option(None, "--name", help="Serve the model under this name."),
    speculation: str = typer.Option("auto", "--speculation", help=SPECULATION_OPTION_HELP),
    draft_model: str | None = typer.Option(None, "--draft-model", help=DRAFT_MODEL_OPTION_HELP),
    prompt_cache_gb: float = typer.Option(2.0, "--prompt-cache-gb", help=PROMPT_CACHE_OPTION_HELP),
    prompt_cache_disk_gb: float | None = typer.Option(
        None, "--prompt-cache-disk-gb", help=DISK_CACHE_OPTION_HELP
    ),
    memory_gb: float | None = typer.Option(None, "--memory-gb", help=MEMORY_OPTION_HELP),
) -> None:
    """Serve MODEL over HTTP (OpenAI chat completions, /v1/models, /health)."""
    from worker.engine.core import EngineError
    from worker.serve.main import exit_process, run

    check_worker_options(speculation, prompt_cache_gb, prompt_cache_disk_gb, memory_gb)
    try:
        run(
            model,
            host=host,
            port=port,
            home=resolve_home(home),
            name=name,
            speculation=speculation,
            draft_model=draft_model,
            prompt_cache_gb=prompt_cache_gb,
            prompt_cache_disk_gb=prompt_cache_disk_gb,
            memory_gb=memory_gb,
        )
    except KeyboardInterrupt:
        exit_process(0)
    except EngineError as exc:
        raise fail(str(exc)) from exc
    except LookupError as exc:
        raise fail(f"unknown model {model!r}: {exc}") from exc
    except OSError as exc:
        raise fail(f"cannot serve on {host}:{port}: {exc}") from exc
    exit_process(0)
