"""PNG plots of a probe run over time: TTFT, tok/s and failures (matplotlib, Agg backend)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

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
