"""Writing the probe's outputs: JSONL rows as they arrive, then summary.json and summary.md."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import IO

import orjson
from rich.table import Table

from lab.rows import ProbeRow
from lab.stats import GroupStats, Summary
from lab.verdict import Verdict


class RowWriter:
    """Appends one JSON line per row and flushes, so a killed probe still leaves its data."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file: IO[bytes] = path.open("ab")

    def write(self, row: ProbeRow) -> None:
        self._file.write(orjson.dumps(row.model_dump(mode="json")) + b"\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_rows(path: Path) -> list[ProbeRow]:
    """Rows of a JSONL file (a torn last line from a killed writer is skipped)."""
    rows = []
    for line in path.read_bytes().splitlines():
        if not line.strip():
            continue
        try:
            rows.append(ProbeRow.model_validate(orjson.loads(line)))
        except orjson.JSONDecodeError:
            continue
    return rows


def _num(value: float | None, fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


def _table(groups: Sequence[GroupStats], key: str) -> list[str]:
    lines = [
        f"| target | model | {key} | requests | ok | success | hung | improper | sentinel | TTFT p50 s | TTFT p95 s | tok/s p50 |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for g in groups:
        sentinel = f"{g.sentinel_passed}/{g.sentinel_checked}" if g.sentinel_checked else "–"
        lines.append(
            f"| {g.target} | {g.model} | {getattr(g, key)} | {g.requests} | {g.ok} "
            f"| {g.success_rate:.1%} | {g.hung} | {g.improper_failures} | {sentinel} "
            f"| {_num(g.ttft_p50_s, '.3f')} | {_num(g.ttft_p95_s, '.3f')} | {_num(g.tok_s_p50, '.1f')} |"
        )
    return lines


def render_markdown(summary: Summary, title: str = "Probe summary") -> str:
    lines = [
        f"# {title}",
        "",
        f"- requests: {summary.requests}, ok: {summary.ok} ({summary.success_rate:.1%})",
        f"- **hung: {summary.hung}** (streams that never terminated; must be 0)",
        f"- outcomes: {', '.join(f'{k} {v}' for k, v in summary.outcomes.items()) or 'none'}",
        "- *sentinel* = the exact word came back (answer quality, separate from transport "
        "success; tiny random-weight models never pass it)",
        "",
        "## Per model × API",
        "",
        *_table(summary.groups, "api"),
        "",
        "## Per model × route (x-route header; `-` = no route header, usually a failure)",
        "",
        *_table(summary.routes, "route"),
    ]
    if summary.ab:
        lines += [
            "",
            "## A/B (b ÷ a)",
            "",
            "| model | api | success | TTFT p50 | tok/s p50 |",
            "|---|---|---:|---:|---:|",
        ]
        for r in summary.ab:
            lines.append(
                f"| {r.model} | {r.api} | {_num(r.success_rate_b_over_a, '.2f')} "
                f"| {_num(r.ttft_p50_b_over_a, '.2f')} | {_num(r.tok_s_p50_b_over_a, '.2f')} |"
            )
    return "\n".join(lines) + "\n"


def write_summary(out_dir: Path, summary: Summary, rows: Iterable[ProbeRow] = ()) -> list[Path]:
    """summary.json, summary.md and (when there are rows) the PNG plots; returns the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / "summary.json", out_dir / "summary.md"
    json_path.write_bytes(orjson.dumps(summary.model_dump(mode="json"), option=orjson.OPT_INDENT_2))
    md_path.write_text(render_markdown(summary))
    written = [json_path, md_path]
    rows = list(rows)
    if rows:
        from lab.plots import write_plots  # matplotlib is slow to import: only when plotting

        written += write_plots(out_dir, rows)
    return written


def verdict_table(verdict: Verdict) -> Table:
    table = Table(title=f"scenario {verdict.scenario}: {'PASS' if verdict.passed else 'FAIL'}")
    table.add_column("measure")
    table.add_column("value", justify="right")
    identical = "n/a" if verdict.compared is None else f"{verdict.identical}/{verdict.compared}"
    recovery = (
        "n/a"
        if verdict.recovery_s is None and verdict.recovered
        else (f"{verdict.recovery_s:.1f} s" if verdict.recovery_s is not None else "not recovered")
    )
    rows = [
        ("requests sent", str(verdict.sent)),
        ("succeeded", f"{verdict.succeeded} ({verdict.success_rate:.1%})"),
        ("failed with a proper error", str(verdict.failed_proper)),
        ("failed otherwise (timeout, cut off, refused)", str(verdict.failed_improper)),
        ("hung (must be 0)", f"[{'red' if verdict.hung else 'green'}]{verdict.hung}[/]"),
        ("outputs identical to the no-fault run", identical),
        ("time to recover", recovery),
    ]
    for phase in verdict.phases:
        rows.append(
            (
                f"{phase.phase}: ok / TTFT p50, p95",
                f"{phase.ok}/{phase.requests} · {_num(phase.ttft_p50_s, '.3f')} s, "
                f"{_num(phase.ttft_p95_s, '.3f')} s",
            )
        )
    for name, value in rows:
        table.add_row(name, value)
    for reason in verdict.reasons:
        table.add_row("[red]reason[/]", reason)
    return table
