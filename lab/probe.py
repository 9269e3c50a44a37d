"""The probe: measure a live gateway through every client API, on an interval.

    python lab/probe.py --url http://127.0.0.1:9337 [--models a,b] [--apis chat,responses,messages]
        [--interval S] [--duration S | --count N] [--out DIR] [--ab URL2] [--api-key K]

Each round lists the models, then for every model and API sends a non-stream *sentinel* request
(one exact word at temperature 0, thinking off: ``sentinel_ok`` says whether the word came back –
answer quality, recorded apart from transport success) and a streamed request (TTFT, tok/s).
With ``--ab`` the two gateways are interleaved. Rows go to ``rows.jsonl`` as they arrive; on
exit (Ctrl-C included) ``summary.json``, ``summary.md`` and PNG plots are written.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx
from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from lab.measure import Target, list_models, measure_request
from lab.report import RowWriter, write_summary
from lab.rows import API_NAMES, ApiName, Outcome, ProbeRow
from lab.stats import Summary, summarize

SENTINEL_WORD = "pineapple"
SENTINEL_PROMPT = f"Reply with exactly one word: {SENTINEL_WORD}. No punctuation, nothing else."
STREAM_PROMPT = "Count from one to twenty in words, separated by spaces."


def default_out(package_dir: Path = Path(__file__).resolve().parent) -> Path:
    """Where probe runs go without ``--out``: ``lab/out`` in a checkout (git-ignored); from an
    installed copy, ``./lab-out`` in the current directory, never inside site-packages."""
    if (package_dir.parent / "pyproject.toml").is_file():
        return package_dir / "out"
    return Path.cwd() / "lab-out"


@dataclass
class ProbeConfig:
    """Everything a probe run needs; built by the CLIs, never read from the environment."""

    urls: list[str]  # one gateway, or two for A/B ("a" then "b")
    models: list[str] | None = None  # None: every model in /v1/models plus "mesh"
    apis: list[ApiName] = field(default_factory=lambda: list(API_NAMES))
    interval_s: float = 5.0
    duration_s: float | None = None
    count: int | None = None  # rounds; with neither count nor duration: until Ctrl-C
    out_dir: Path | None = None
    api_key: str | None = None
    timeout_s: float = 60.0
    max_tokens: int = 24
    sentinel: bool = True
    include_mesh: bool = True
    show_progress: bool = True

    def targets(self) -> list[Target]:
        return [Target(name, url.rstrip("/")) for name, url in zip("ab", self.urls, strict=False)]


class Prober:
    """Runs rounds against the targets and hands every row to ``on_row`` as it completes."""

    def __init__(
        self,
        config: ProbeConfig,
        *,
        client: httpx.AsyncClient | None = None,
        on_row: Callable[[ProbeRow], None] | None = None,
    ) -> None:
        if not 1 <= len(config.urls) <= 2:
            raise ValueError("the probe takes one gateway URL, or two for A/B")
        self.config = config
        self.rows: list[ProbeRow] = []
        self._client = client
        self._on_row = on_row
        self._known_models: dict[str, list[str]] = {}

    def _record(self, row: ProbeRow) -> None:
        self.rows.append(row)
        if self._on_row is not None:
            self._on_row(row)

    async def _models_for(self, client: httpx.AsyncClient, target: Target) -> list[str]:
        row, ids = await list_models(
            client, target, timeout_s=self.config.timeout_s, api_key=self.config.api_key
        )
        self._record(row)
        if self.config.models is not None:
            return list(self.config.models)
        if row.ok:  # a failed listing keeps the last known set, so probing goes on
            self._known_models[target.name] = ids + (
                ["mesh"] if self.config.include_mesh and "mesh" not in ids else []
            )
        return self._known_models.get(target.name, [])

    async def run_round(self, client: httpx.AsyncClient, round_no: int) -> None:
        targets = self.config.targets()
        models = {t.name: await self._models_for(client, t) for t in targets}
        if round_no % 2:  # A/B: alternate who goes first, so drift hits both alike
            targets.reverse()
        all_models = list(dict.fromkeys(m for t in targets for m in models[t.name]))
        for model in all_models:
            for api in self.config.apis:
                for target in targets:
                    if model in models[target.name]:
                        await self._probe_model(client, target, model, api)

    async def _probe_model(
        self, client: httpx.AsyncClient, target: Target, model: str, api: ApiName
    ) -> None:
        common = dict(
            api=api,
            model=model,
            timeout_s=self.config.timeout_s,
            api_key=self.config.api_key,
        )
        if self.config.sentinel:
            self._record(
                await measure_request(
                    client,
                    target,
                    prompt=SENTINEL_PROMPT,
                    stream=False,
                    max_tokens=8,
                    sentinel_word=SENTINEL_WORD,
                    **common,
                )
            )
        self._record(
            await measure_request(
                client,
                target,
                prompt=STREAM_PROMPT,
                stream=True,
                max_tokens=self.config.max_tokens,
                **common,
            )
        )

    async def run(self, stop: asyncio.Event | None = None) -> list[ProbeRow]:
        """Rounds every ``interval_s`` until count/duration is reached or ``stop`` is set."""
        stop = stop or asyncio.Event()
        config = self.config
        started = time.monotonic()
        client = self._client or httpx.AsyncClient(
            timeout=httpx.Timeout(config.timeout_s + 5), trust_env=False
        )
        try:
            round_no = 0
            while not stop.is_set():
                if config.count is not None and round_no >= config.count:
                    break
                if (
                    config.duration_s is not None
                    and time.monotonic() - started >= config.duration_s
                ):
                    break
                round_started = time.monotonic()
                await self.run_round(client, round_no)
                round_no += 1
                wait = config.interval_s - (time.monotonic() - round_started)
                if config.duration_s is not None:
                    wait = min(wait, config.duration_s - (time.monotonic() - started))
                if wait > 0 and (config.count is None or round_no < config.count):
                    try:
                        await asyncio.wait_for(stop.wait(), wait)
                    except TimeoutError:
                        pass  # the interval elapsed: next round
        finally:
            if self._client is None:
                await client.aclose()
        return self.rows


def _progress_text(rows: Sequence[ProbeRow]) -> str:
    ok = sum(1 for r in rows if r.ok)
    hung = sum(1 for r in rows if r.outcome is Outcome.HUNG)
    failed = len(rows) - ok
    last = rows[-1] if rows else None
    tail = f" last: {last.model}/{last.api or 'models'} {last.outcome.value}" if last else ""
    return f"probes {len(rows)} ok {ok} failed {failed} [{'red' if hung else 'green'}]hung {hung}[/]{tail}"


async def run_probe(config: ProbeConfig, console: Console | None = None) -> Summary:
    """Run the probe with a progress line; always writes the outputs it has, even when cancelled."""
    console = console or Console(stderr=True)
    out_dir = config.out_dir or default_out() / time.strftime("probe-%Y%m%d-%H%M%S")
    writer = RowWriter(out_dir / "rows.jsonl")
    progress = Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        TimeElapsedColumn(),
        console=console,
        disable=not config.show_progress,
    )
    total = config.count if config.count is not None else None
    task = progress.add_task("starting", total=total)

    def on_row(row: ProbeRow) -> None:
        writer.write(row)
        if row.kind == "models" and row.target == "a":
            progress.advance(task)
        progress.update(task, description=_progress_text(prober.rows))

    prober = Prober(config, on_row=on_row)
    try:
        with progress:
            await prober.run()
    finally:
        writer.close()
        summary = summarize(prober.rows)
        paths = write_summary(out_dir, summary, prober.rows)
        console.print(
            f"{len(prober.rows)} probes; wrote {writer.path} and {', '.join(p.name for p in paths)}"
        )
    return summary


def parse_args(argv: Sequence[str] | None = None) -> ProbeConfig:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="gateway base URL, e.g. http://127.0.0.1:9337")
    parser.add_argument("--models", help="comma-separated model ids (default: all listed + mesh)")
    parser.add_argument("--apis", default=",".join(API_NAMES), help="chat,responses,messages")
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between round starts")
    until = parser.add_mutually_exclusive_group()
    until.add_argument("--duration", type=float, help="stop after this many seconds")
    until.add_argument("--count", type=int, help="stop after this many rounds")
    parser.add_argument("--out", type=Path, help="output directory (default lab/out/probe-<time>)")
    parser.add_argument("--ab", help="second gateway URL: interleave both, report b/a ratios")
    parser.add_argument("--api-key")
    parser.add_argument("--timeout", type=float, default=60.0, help="hard per-request deadline (s)")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--no-sentinel", action="store_true", help="skip the non-stream check")
    parser.add_argument("--no-mesh", action="store_true", help='do not add model "mesh"')
    args = parser.parse_args(argv)
    apis = [a.strip() for a in args.apis.split(",") if a.strip()]
    unknown = sorted(set(apis) - set(API_NAMES))
    if unknown:
        parser.error(f"unknown api {', '.join(unknown)}: choose from {', '.join(API_NAMES)}")
    return ProbeConfig(
        urls=[args.url] + ([args.ab] if args.ab else []),
        models=[m.strip() for m in args.models.split(",") if m.strip()] if args.models else None,
        apis=apis,  # type: ignore[arg-type]  # checked against API_NAMES above
        interval_s=args.interval,
        duration_s=args.duration,
        count=args.count,
        out_dir=args.out,
        api_key=args.api_key,
        timeout_s=args.timeout,
        max_tokens=args.max_tokens,
        sentinel=not args.no_sentinel,
        include_mesh=not args.no_mesh,
    )


def run_probe_cli(config: ProbeConfig) -> int:
    """Run to completion or Ctrl-C; exit status 0 only when nothing hung."""
    try:
        summary = asyncio.run(run_probe(config))
    except KeyboardInterrupt:
        return 130
    return 1 if summary.hung else 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_probe_cli(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
