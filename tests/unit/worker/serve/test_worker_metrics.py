"""The worker's /metrics: its budget, both prompt-cache tiers and the hits, read from the
engine's snapshots at each scrape; absent sources give families without samples."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prometheus_client import generate_latest
from starlette.applications import Starlette
from starlette.routing import Route
from starlette.testclient import TestClient

from worker.serve.metrics import make_registry, metrics


@dataclass
class Facts:
    memory_budget: dict[str, int] | None = None
    prompt_cache: dict[str, Any] = field(default_factory=dict)
    prompt_cache_disk: dict[str, Any] | None = None


def _text(facts: Facts) -> str:
    return generate_latest(make_registry("tiny", facts)).decode()


def test_every_number_is_exported_with_the_model_label() -> None:
    facts = Facts(
        memory_budget={
            "limit_bytes": 1000,
            "used_bytes": 600,
            "running_kv_bytes": 400,
            "prompt_cache_bytes": 200,
            "kv_bytes_per_token": 8,
        },
        prompt_cache={
            "entries": 2,
            "bytes": 200,
            "max_bytes": 500,
            "prefixes": 3,
            "hits": 5,
            "misses": 1,
            "cached_tokens": 700,
        },
        prompt_cache_disk={"entries": 1, "bytes": 900, "max_bytes": 5000, "writes": 4, "loads": 2},
    )
    text = _text(facts)
    for line in (
        'worker_memory_budget_bytes{model="tiny"} 1000.0',
        'worker_memory_used_bytes{model="tiny"} 600.0',
        'worker_memory_running_kv_bytes{model="tiny"} 400.0',
        'worker_prompt_cache_memory_bytes{model="tiny"} 200.0',
        'worker_prompt_cache_memory_entries{model="tiny"} 2.0',
        'worker_prompt_cache_prefixes{model="tiny"} 3.0',
        'worker_prompt_cache_hits_total{model="tiny"} 5.0',
        'worker_prompt_cache_misses_total{model="tiny"} 1.0',
        'worker_prompt_cache_disk_bytes{model="tiny"} 900.0',
        'worker_prompt_cache_disk_entries{model="tiny"} 1.0',
        'worker_prompt_cache_disk_loads_total{model="tiny"} 2.0',
    ):
        assert line in text, line


def test_no_budget_and_no_disk_tier_export_no_samples() -> None:
    text = _text(Facts(prompt_cache={"entries": 0, "bytes": 0}))
    assert "# TYPE worker_memory_budget_bytes gauge" in text
    assert "worker_memory_budget_bytes{" not in text
    assert "worker_prompt_cache_disk_bytes{" not in text
    assert 'worker_prompt_cache_memory_entries{model="tiny"} 0.0' in text


def test_the_route_answers_prometheus_text() -> None:
    app = Starlette(routes=[Route("/metrics", metrics)])
    app.state.metrics = make_registry("tiny", Facts(prompt_cache={"hits": 1}))
    response = TestClient(app).get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert 'worker_prompt_cache_hits_total{model="tiny"} 1.0' in response.text
