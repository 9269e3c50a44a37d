"""Run several scenarios one after another and write one markdown table of their verdicts.

python -m lab.suite [SCENARIO ...] --out DIR [--markdown FILE]   (default: every bundled one)
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console

from lab.netlab import LabOptions, run_scenario
from lab.nodes import LabError
from lab.scenario import SCENARIO_DIR, load_scenario
from lab.verdict import Verdict


def _num(value: float | None, fmt: str = ".2f") -> str:
    return "–" if value is None else format(value, fmt)


def _floor_cell(verdict: Verdict) -> str:
    if verdict.fault_requests is None:
        return "n/a"
    floor = "" if verdict.min_success is None else f" ≥ {verdict.min_success:.0%}"
    return f"{verdict.fault_ok}/{verdict.fault_requests}{floor}"


def _slowest_error_cell(verdict: Verdict) -> str:
    bound = "" if verdict.max_time_to_error_s is None else f" ≤ {verdict.max_time_to_error_s:g}"
    return f"{_num(verdict.slowest_error_s, '.1f')}{bound}"


def verdict_row(verdict: Verdict) -> str:
    phases = {p.phase: p for p in verdict.phases}
    cells = []
    for name in ("before faults", "during", "after"):
        phase = phases.get(name)
        cells.append(
            "–"
            if phase is None or not phase.requests
            else f"{phase.ok}/{phase.requests} · {_num(phase.ttft_p50_s)} / {_num(phase.ttft_p95_s)}"
        )
    identical = "n/a" if verdict.compared is None else f"{verdict.identical}/{verdict.compared}"
    recovery = (
        f"{verdict.recovery_s:.1f} s"
        if verdict.recovery_s is not None
        else ("n/a" if verdict.recovered else "no")
    )
    status = "pass" if verdict.passed else "FAIL: " + "; ".join(verdict.reasons)
    return (
        f"| {verdict.scenario} | {verdict.sent} | {verdict.succeeded} | {verdict.failed_proper} "
        f"| {verdict.failed_improper} | **{verdict.hung}** | {_floor_cell(verdict)} "
        f"| {_slowest_error_cell(verdict)} | {identical} | {recovery} "
        f"| {' | '.join(cells)} | {status} |"
    )


HEADER = (
    "| scenario | sent | ok | proper errors | improper failures | hung "
    "| fault phase: ok ≥ floor | slowest error ≤ bound, s | identical outputs "
    "| recovery | before: ok · TTFT p50 / p95 s | during | after | verdict |\n"
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|---|"
)


def render(verdicts: Sequence[Verdict]) -> str:
    return "\n".join([HEADER, *(verdict_row(v) for v in verdicts)]) + "\n"


async def run_suite(names: Sequence[str], out: Path, console: Console) -> list[Verdict]:
    verdicts = []
    for name in names:
        scenario = load_scenario(name)
        console.rule(f"{scenario.name}: {scenario.description}")
        started = time.monotonic()
        try:
            result = await run_scenario(scenario, LabOptions(out_dir=out / scenario.name), console)
        except LabError as exc:
            console.print(f"[red]{scenario.name}: the lab could not run it: {exc}[/]")
            continue
        console.print(
            f"{scenario.name}: {'pass' if result.verdict.passed else 'FAIL'} in {time.monotonic() - started:.0f}s"
        )
        verdicts.append(result.verdict)
    return verdicts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("scenarios", nargs="*", help="names or files (default: all bundled)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--markdown", type=Path, help="write the table here too")
    args = parser.parse_args(argv)
    names = args.scenarios or sorted(
        p.stem
        for p in SCENARIO_DIR.glob("*.toml")
        if load_scenario(p).sessions is None  # replayed sessions: lab.routing_compare
    )
    console = Console(stderr=True)
    try:
        verdicts = asyncio.run(run_suite(names, args.out, console))
    except KeyboardInterrupt:
        return 130
    table = render(verdicts)
    print(table)
    if args.markdown:
        args.markdown.write_text(table)
    return 0 if verdicts and all(v.passed for v in verdicts) and len(verdicts) == len(names) else 1


if __name__ == "__main__":
    sys.exit(main())
