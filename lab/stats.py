"""Summary statistics over probe rows: pure functions, no I/O."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence

from pydantic import BaseModel

from lab.rows import Outcome, ProbeRow


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default method); None for no values."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile out of range: {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


class GroupStats(BaseModel):
    """One model × route (× target, × api) cell of the summary."""

    target: str
    model: str
    route: str
    api: str
    requests: int
    ok: int
    success_rate: float
    outcomes: dict[str, int]
    proper_failures: int
    improper_failures: int  # hung, timeout, truncated, transport errors, improper 5xx
    hung: int
    sentinel_checked: int
    sentinel_passed: int
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    tok_s_p50: float | None


class Ratio(BaseModel):
    """A/B: target b divided by target a, per model × api (None where either side lacks data)."""

    model: str
    api: str
    success_rate_b_over_a: float | None
    ttft_p50_b_over_a: float | None
    tok_s_p50_b_over_a: float | None


class Summary(BaseModel):
    requests: int
    ok: int
    success_rate: float
    hung: int
    outcomes: dict[str, int]
    groups: list[GroupStats]  # per target × model × api (route "*")
    routes: list[GroupStats]  # per target × model × route (api "*"): where requests went
    ab: list[Ratio] = []


def _rate(part: int, whole: int) -> float:
    return part / whole if whole else 0.0


def group_stats(
    rows: Sequence[ProbeRow], *, target: str, model: str, route: str, api: str
) -> GroupStats:
    counts = Counter(row.outcome.value for row in rows)
    ok = counts.get(Outcome.OK.value, 0)
    proper = sum(1 for row in rows if row.failed_properly)
    streamed = [row for row in rows if row.kind == "stream" and row.ok]
    ttfts = [row.ttft_s for row in streamed if row.ttft_s is not None]
    rates = [row.tok_s for row in streamed if row.tok_s is not None]
    sentinels = [row for row in rows if row.sentinel_ok is not None]
    return GroupStats(
        target=target,
        model=model,
        route=route,
        api=api,
        requests=len(rows),
        ok=ok,
        success_rate=_rate(ok, len(rows)),
        outcomes=dict(sorted(counts.items())),
        proper_failures=proper,
        improper_failures=len(rows) - ok - proper,
        hung=counts.get(Outcome.HUNG.value, 0),
        sentinel_checked=len(sentinels),
        sentinel_passed=sum(1 for row in sentinels if row.sentinel_ok),
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p95_s=percentile(ttfts, 95),
        tok_s_p50=percentile(rates, 50),
    )


def _ratio(b: float | None, a: float | None) -> float | None:
    if a is None or b is None or a == 0:
        return None
    return b / a


def ab_ratios(rows: Sequence[ProbeRow]) -> list[Ratio]:
    """Per model × api, target b against target a (only when both targets have rows)."""
    keys = sorted({(row.model, row.api or "models") for row in rows})
    out: list[Ratio] = []
    for model, api in keys:
        cells = {}
        for target in ("a", "b"):
            subset = [
                r
                for r in rows
                if r.target == target and r.model == model and (r.api or "models") == api
            ]
            if not subset:
                break
            cells[target] = group_stats(subset, target=target, model=model, route="*", api=api)
        if len(cells) < 2:
            continue
        a, b = cells["a"], cells["b"]
        out.append(
            Ratio(
                model=model,
                api=api,
                success_rate_b_over_a=_ratio(b.success_rate, a.success_rate),
                ttft_p50_b_over_a=_ratio(b.ttft_p50_s, a.ttft_p50_s),
                tok_s_p50_b_over_a=_ratio(b.tok_s_p50, a.tok_s_p50),
            )
        )
    return out


def _grouped(rows: Sequence[ProbeRow], by_route: bool) -> list[GroupStats]:
    buckets: dict[tuple[str, str, str, str], list[ProbeRow]] = {}
    for row in rows:
        if by_route:
            # Failed requests often carry no route header: they show up as route "-".
            key = (row.target, row.model, row.route or "-", "*")
        else:
            key = (row.target, row.model, "*", row.api or "models")
        buckets.setdefault(key, []).append(row)
    return [
        group_stats(bucket, target=t, model=m, route=r, api=a)
        for (t, m, r, a), bucket in sorted(buckets.items())
    ]


def summarize(rows: Iterable[ProbeRow]) -> Summary:
    """Overall numbers, one group per target × model × api and one per target × model × route."""
    rows = list(rows)
    counts = Counter(row.outcome.value for row in rows)
    ok = counts.get(Outcome.OK.value, 0)
    return Summary(
        requests=len(rows),
        ok=ok,
        success_rate=_rate(ok, len(rows)),
        hung=counts.get(Outcome.HUNG.value, 0),
        outcomes=dict(sorted(counts.items())),
        groups=_grouped(rows, by_route=False),
        routes=_grouped([row for row in rows if row.kind != "models"], by_route=True),
        ab=ab_ratios(rows) if len({row.target for row in rows}) > 1 else [],
    )
