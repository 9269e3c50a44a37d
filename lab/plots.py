"""PNG plots of a lab run over time: a probe run's TTFT, tok/s and failures; a memory run's
RSS per node against its bound (matplotlib, Agg backend)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display: must precede pyplot's import
import matplotlib.pyplot as plt

from lab.rows import Outcome, ProbeRow


def _series_key(row: ProbeRow) -> str:
    prefix = f"{row.target}:" if row.target != "a" else ""
    return f"{prefix}{row.model}/{row.api}"


def _line_plot(path: Path, rows: Sequence[ProbeRow], t0: float, field: str, ylabel: str) -> None:
    series: dict[str, tuple[list[float], list[float]]] = {}
    for row in rows:
        value = getattr(row, field)
        if row.kind != "stream" or not row.ok or value is None:
            continue
        xs, ys = series.setdefault(_series_key(row), ([], []))
        xs.append(row.t - t0)
        ys.append(value)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for name, (xs, ys) in sorted(series.items()):
        ax.plot(xs, ys, marker=".", linewidth=1, label=name)
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if series:
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _failure_plot(path: Path, rows: Sequence[ProbeRow], t0: float) -> None:
    failed = [row for row in rows if not row.ok]
    outcomes = sorted({row.outcome.value for row in failed})
    fig, ax = plt.subplots(figsize=(9, 3.5))
    for index, outcome in enumerate(outcomes):
        xs = [row.t - t0 for row in failed if row.outcome.value == outcome]
        ax.scatter(xs, [index] * len(xs), marker="|", s=200, label=outcome)
    ax.set_yticks(range(len(outcomes)), outcomes)
    ax.set_xlabel("time since start (s)")
    title = f"failures: {len(failed)} of {len(rows)}"
    hung = sum(1 for row in rows if row.outcome is Outcome.HUNG)
    ax.set_title(f"{title} (hung: {hung})")
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_plots(out_dir: Path, rows: Sequence[ProbeRow]) -> list[Path]:
    """ttft.png, tok_s.png and failures.png in ``out_dir``."""
    t0 = min(row.t for row in rows)
    paths = [out_dir / "ttft.png", out_dir / "tok_s.png", out_dir / "failures.png"]
    _line_plot(paths[0], rows, t0, "ttft_s", "TTFT (s)")
    _line_plot(paths[1], rows, t0, "tok_s", "tokens/s")
    _failure_plot(paths[2], rows, t0)
    return paths


def rss_plot(path: Path, results: Mapping[str, Mapping[str, Any]]) -> None:
    """Each node's RSS over time, one panel per run that watched memory (lab/memory_watch.py),
    each node's bound (budget + weights + overhead) dashed in its colour."""
    watched = {label: r["memory"] for label, r in results.items() if "memory" in r}
    fig, axes = plt.subplots(
        len(watched), 1, figsize=(9, 3.6 * len(watched)), sharex=True, squeeze=False
    )
    for ax, (label, memory) in zip(axes[:, 0], watched.items(), strict=True):
        lines = Path(memory["samples_file"]).read_text().splitlines()
        samples = [json.loads(line) for line in lines if line.strip()]
        for node in sorted({s["node"] for s in samples}):
            colour = f"C{node}"
            for start in sorted({s["start"] for s in samples if s["node"] == node}):
                mine = [s for s in samples if s["node"] == node and s["start"] == start]
                name = f"node {node}" + (f" (start {start})" if start > 1 else "")
                ax.plot(
                    [s["t"] for s in mine],
                    [s["rss"] / (1 << 20) for s in mine],
                    color=colour,
                    linewidth=1.2,
                    linestyle="-" if start == 1 else "-.",
                    label=name,
                )
            bound = memory["bound"].get(node) or memory["bound"].get(str(node))
            if bound:
                ax.axhline(
                    bound["bound"] / (1 << 20),
                    color=colour,
                    linestyle="--",
                    linewidth=0.9,
                    label=f"node {node} bound",
                )
        for mark in memory.get("marks", []):
            if mark["event"] == "start":
                continue  # the restart's "back" is what shows
            node = mark.get("node")
            what = mark["event"] if node is None else f"node {node} {mark['event']}"
            ax.axvline(mark["t"], color="grey", linestyle=":", linewidth=0.8)
            ax.annotate(
                what, (mark["t"], 1.0), xycoords=("data", "axes fraction"), rotation=90,
                fontsize="x-small", va="top", ha="right", color="grey",
            )  # fmt: skip
        ax.set_title(label, fontsize="medium")
        ax.set_ylabel("RSS of the node's processes (MiB)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="x-small", ncol=3)
    axes[-1, 0].set_xlabel("time since the nodes were up (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
