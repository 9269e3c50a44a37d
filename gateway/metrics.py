"""Prometheus metrics (one registry per app, so several gateways can live in one process) and
the JSONL request log: one row per finished request, written after the response."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import orjson
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import Metric

from gateway.answer import Accumulator
from gateway.cache_view import NodeCacheStats
from worker.serve.metrics import table_families

log = logging.getLogger(__name__)

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30)
_DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300)


@dataclass
class RequestRecord:
    """What one request did: the metrics update and the request-log row."""

    api: str
    model: str
    stream: bool
    started: float = field(default_factory=time.time)
    outcome: str = "ok"  # ok | error kind | cancelled
    status: int = 200
    ttft_s: float | None = None
    duration_s: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    route: dict[str, str] = field(default_factory=dict)
    route_reason: str | None = None  # why the mesh sent it where it went (x-mesh-route-reason)

    def count_tokens(self, acc: Accumulator) -> None:
        """The answer's token counts, when its upstream reported them."""
        if acc.usage is not None:
            self.prompt_tokens = acc.prompt_tokens
            self.completion_tokens = acc.completion_tokens
            self.cached_tokens = acc.cached_tokens


class MoaMetrics:
    """What ``model="mesh"`` decisions cost, from their ``x-moa-*`` route facts."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "gateway_moa_requests",
            "mesh requests by policy and the rule that decided",
            ["policy", "decision"],
            registry=registry,
        )
        self.candidates = Counter(
            "gateway_moa_candidates",
            "mesh candidates by policy and fate (started; stopped by the decision; finished "
            "without an answer to vote with; shown to the judge model)",
            ["policy", "fate"],
            registry=registry,
        )
        self.decision = Histogram(
            "gateway_moa_decision_seconds",
            "From the fan-out to the decision",
            ["policy"],
            buckets=_TTFT_BUCKETS,
            registry=registry,
        )

    def observe(self, route: dict[str, str]) -> None:
        policy = route.get("x-moa-policy")
        if policy is None:
            return
        self.requests.labels(policy, route.get("x-moa-decision") or "none").inc()
        for fate, header in (
            ("started", "x-moa-workers"),
            ("stopped", "x-moa-stopped"),
            ("abstained", "x-moa-abstained"),
            ("judged", "x-moa-options"),
        ):
            count = _count(route.get(header))
            if count:
                self.candidates.labels(policy, fate).inc(count)
        decided_ms = _count(route.get("x-moa-decision-ms"))
        if "x-moa-decision-ms" in route:
            self.decision.labels(policy).observe(decided_ms / 1000)


def _count(value: str | None) -> int:
    try:
        return max(0, int(value or 0))
    except ValueError:
        return 0


# The workers' /health speculation block → (metric, kind, help); counters since the worker started.
_SPECULATION = {
    "verify_steps": ("verify_steps", "counter", "forward passes that checked drafted tokens"),
    "drafted": ("drafted_tokens", "counter", "tokens drafted"),
    "accepted": ("accepted_tokens", "counter", "drafted tokens the model accepted"),
    "acceptance_rate": ("acceptance_rate", "gauge", "accepted / drafted since start"),
    "tokens_per_step": ("tokens_per_step", "gauge", "tokens a verify pass gave each request"),
    "empty_drafts": ("empty_drafts", "counter", "rows whose context matched but drafted nothing"),
    "declined": (
        "declined_steps",
        "counter",
        "steps with drafts a plain step was expected to beat",
    ),
}


class WorkerSpeculation:
    """The local workers' speculative-decoding counters, per served model, as the node's status
    picture carries them (``workers.<model>.speculation``: the worker's ``/health`` block, as
    fresh as the node's last poll of it). A collector: read at each scrape."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.snapshot: dict[str, Mapping[str, Any]] = {}
        registry.register(self)

    def update(self, workers: Mapping[str, Any]) -> None:
        self.snapshot = {
            model: block
            for model, worker in workers.items()
            if isinstance(worker, Mapping)
            and isinstance(block := worker.get("speculation"), Mapping)
        }

    def describe(self) -> list[Metric]:
        return []  # the models are known only at scrape time

    def collect(self) -> Iterator[Metric]:
        samples = [([model], block) for model, block in sorted(self.snapshot.items())]
        yield from table_families(_SPECULATION, ["model"], samples, "gateway_worker_speculation_")


class GatewayMetrics:
    def __init__(self, log_path: Path | None = None) -> None:
        self.registry = CollectorRegistry()
        self.listeners: list[Callable[[RequestRecord], None]] = []
        self.requests = Counter(
            "gateway_requests",
            "Requests by API, model and outcome",
            ["api", "model", "outcome"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "gateway_ttft_seconds",
            "Time to first content delta",
            ["api"],
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self.duration = Histogram(
            "gateway_request_duration_seconds",
            "Request duration",
            ["api"],
            buckets=_DURATION_BUCKETS,
            registry=self.registry,
        )
        self.tokens = Counter(
            "gateway_tokens", "Tokens by direction", ["direction"], registry=self.registry
        )
        self.in_flight = Gauge("gateway_in_flight", "Requests being served", registry=self.registry)
        self.moa = MoaMetrics(self.registry)
        self.speculation = WorkerSpeculation(self.registry)
        self.node_cache = NodeCacheStats(self.registry)  # every node's prompt cache in brief
        self._log_path = log_path
        if log_path is not None:
            log_path.parent.mkdir(parents=True, exist_ok=True)

    def observe(self, record: RequestRecord) -> None:
        for listener in self.listeners:  # e.g. the console's recent-requests table
            try:
                listener(record)
            except Exception:  # a display's bug must not break the request's bookkeeping
                log.exception("request listener %r failed", listener)
        # Clients choose model strings: unknown ones share one label (bounded cardinality).
        rejected = record.outcome in ("not_found", "invalid_request", "too_large")
        model = "(unknown)" if rejected else record.model
        self.requests.labels(record.api, model, record.outcome).inc()
        if record.ttft_s is not None:
            self.ttft.labels(record.api).observe(record.ttft_s)
        self.duration.labels(record.api).observe(record.duration_s)
        self.tokens.labels("in").inc(record.prompt_tokens)
        self.tokens.labels("out").inc(record.completion_tokens)
        self.tokens.labels("cached").inc(record.cached_tokens)
        self.moa.observe(record.route)
        if self._log_path is not None:
            try:
                with self._log_path.open("ab") as fh:
                    fh.write(orjson.dumps(asdict(record)) + b"\n")
            except OSError as exc:  # a full disk must not fail requests; say so once per row
                log.warning("request log write failed: %s", exc)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
