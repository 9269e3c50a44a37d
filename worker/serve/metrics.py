"""The worker's ``GET /metrics``: Prometheus text of its memory budget and prompt cache.

One registry per app (several workers can live in one test process). A collector reads the
engine's plain-number snapshots at each scrape – the same ones ``/health`` shows – so nothing
is counted twice and nothing runs on the engine's thread. A family whose source is absent (no
budget, no disk tier) is exported without samples.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from starlette.requests import Request
from starlette.responses import Response

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class CacheFacts(Protocol):
    """What the collector reads: the engine's snapshots (worker/engine/core.py)."""

    @property
    def memory_budget(self) -> dict[str, int] | None: ...

    @property
    def prompt_cache(self) -> dict[str, Any]: ...

    @property
    def prompt_cache_disk(self) -> dict[str, Any] | None: ...


# (snapshot, its key) → (metric name, kind, help)
_BUDGET = {
    "limit_bytes": ("worker_memory_budget_bytes", "gauge", "the worker's memory budget"),
    "used_bytes": ("worker_memory_used_bytes", "gauge", "budget in use: running KV + cache"),
    "running_kv_bytes": ("worker_memory_running_kv_bytes", "gauge", "KV reserved by running rows"),
    "prompt_cache_bytes": (
        "worker_memory_prompt_cache_bytes",
        "gauge",
        "the memory tier and pending commits, as the budget counts them",
    ),
}
_MEMORY_TIER = {
    "bytes": ("worker_prompt_cache_memory_bytes", "gauge", "bytes in the memory tier"),
    "max_bytes": ("worker_prompt_cache_memory_max_bytes", "gauge", "the memory tier's bound"),
    "entries": ("worker_prompt_cache_memory_entries", "gauge", "entries in the memory tier"),
    "prefixes": (
        "worker_prompt_cache_prefixes",
        "gauge",
        "distinct prefixes held in memory or on disk",
    ),
    "hits": ("worker_prompt_cache_hits", "counter", "lookups that found a cached prefix"),
    "misses": ("worker_prompt_cache_misses", "counter", "lookups that found none"),
    "prompt_tokens": ("worker_prompt_cache_prompt_tokens", "counter", "prompt tokens looked up"),
    "cached_tokens": ("worker_prompt_cache_cached_tokens", "counter", "prompt tokens served"),
}
_DISK_TIER = {
    "bytes": ("worker_prompt_cache_disk_bytes", "gauge", "bytes in the disk tier"),
    "max_bytes": ("worker_prompt_cache_disk_max_bytes", "gauge", "the disk tier's bound"),
    "entries": ("worker_prompt_cache_disk_entries", "gauge", "entries in the disk tier"),
    "writes": ("worker_prompt_cache_disk_writes", "counter", "entries written to disk"),
    "loads": ("worker_prompt_cache_disk_loads", "counter", "entries loaded back from disk"),
    "skipped": ("worker_prompt_cache_disk_skipped", "counter", "unusable files skipped"),
    "evictions": ("worker_prompt_cache_disk_evictions", "counter", "entries the bound removed"),
    "dropped": ("worker_prompt_cache_disk_dropped", "counter", "writes given up (writer behind)"),
}


# A table of metrics: source key → (metric name, kind "counter" | "gauge", help).
MetricTable = Mapping[str, tuple[str, str, str]]


def table_families(
    table: MetricTable,
    labels: list[str],
    samples: Sequence[tuple[list[str], Mapping[str, Any]]],
    prefix: str = "",
) -> Iterator[Metric]:
    """One family per table entry, named ``prefix`` + its name; a sample for each (label
    values, source) whose source has a number at the entry's key. Every family is yielded,
    with no samples when no source has it. Pure; the gateway's per-node and per-model
    collectors use it too."""
    for key, (name, kind, text) in table.items():
        family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
        metric = family(prefix + name, text, labels=labels)
        for values, source in samples:
            value = source.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool):
                metric.add_metric(values, float(value))
        yield metric


def families(
    model: str, snapshots: list[tuple[Mapping[str, Any] | None, MetricTable]]
) -> Iterator[Metric]:
    """The metric families of ``snapshots`` (a snapshot and its key → metric table), one sample
    each labelled ``model`` where the snapshot has a number for it. Pure."""
    for snapshot, table in snapshots:
        yield from table_families(
            table, ["model"], [] if snapshot is None else [([model], snapshot)]
        )


class WorkerCollector:
    """Reads the engine's snapshots at each scrape."""

    def __init__(self, model: str, engine: CacheFacts) -> None:
        self.model = model
        self.engine = engine

    def describe(self) -> list[Metric]:
        return []  # read at scrape time only

    def collect(self) -> Iterator[Metric]:
        engine = self.engine
        yield from families(
            self.model,
            [
                (engine.memory_budget, _BUDGET),
                (engine.prompt_cache, _MEMORY_TIER),
                (engine.prompt_cache_disk, _DISK_TIER),
            ],
        )


def make_registry(model: str, engine: CacheFacts) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(WorkerCollector(model, engine))
    return registry


async def metrics(request: Request) -> Response:
    registry: CollectorRegistry = request.app.state.metrics
    return Response(generate_latest(registry), media_type=CONTENT_TYPE)
