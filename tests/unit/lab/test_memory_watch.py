"""The memory scenario's pure parts: reading RSS, a node's /health figures, counters across
restarts, the bound and its check, the runs it plans and the table it writes."""

from __future__ import annotations

import os

from lab.memory_watch import (
    MB,
    Sample,
    bound_bytes,
    busy_facts,
    check_bound,
    counters,
    health_facts,
    overhead_bytes,
    parse_vm_rss,
    render_memory,
    rss_bytes,
)
from lab.routing_compare import runs
from lab.scenario import load_scenario

STATUS = """Name:\tpython3
State:\tS (sleeping)
VmPeak:\t  812345 kB
VmRSS:\t  132336 kB
RssAnon:\t   90000 kB
Threads:\t12
"""


def test_vm_rss_is_read_in_bytes_and_missing_for_a_zombie() -> None:
    assert parse_vm_rss(STATUS) == 132336 * 1024
    assert parse_vm_rss("Name:\tzombie\nState:\tZ (zombie)\n") is None
    assert parse_vm_rss("VmRSS:\t  2 mB\n") == 2 * MB


def test_this_process_has_an_rss_and_a_gone_one_none() -> None:
    assert rss_bytes(os.getpid()) > MB
    assert rss_bytes(2**22 + 12345) == 0  # above Linux's pid_max default: never a process


def test_health_facts_sum_the_workers_blocks_and_skip_what_is_missing() -> None:
    body = {
        "status": "ok",
        "queue_depth": 3,
        "workers": {
            "a": {
                "memory": {"limit_bytes": 16 * MB, "used_bytes": 5 * MB, "weight_bytes": 4096},
                "prompt_cache": {"bytes": 2 * MB, "evictions": 7},
                "prompt_cache_disk": {"bytes": 9 * MB, "writes": 7, "loads": 2},
            },
            "b": {"memory": None, "prompt_cache": {"bytes": MB, "evictions": 1}},
            "c": "not a block",
        },
    }
    assert health_facts(body) == {
        "budget": 16 * MB,
        "budget_used": 5 * MB,
        "weights": 4096,
        "memory_tier": 3 * MB,
        "evictions": 8,
        "disk_tier": 9 * MB,
        "disk_writes": 7,
        "disk_loads": 2,
    }
    assert health_facts({"status": "ok"}) == {}


def test_counters_add_each_start_s_last_value() -> None:
    """Node 2 wrote 5 before it was killed; its restart counts from 0 again."""
    samples = [
        Sample(1, 0, 1, 10, 2, 5, {"disk_writes": 1}),
        Sample(2, 0, 1, 10, 2, 5, {"disk_writes": 4}),
        Sample(1, 2, 1, 10, 2, 5, {"disk_writes": 5}),
        Sample(9, 2, 2, 10, 2, 5, {"disk_writes": 2}),
        Sample(10, 2, 2, 10, 2, 5, {}),  # no answer that second
    ]
    assert counters(samples, "disk_writes") == 4 + 5 + 2
    assert counters(samples, "evictions") == 0


def test_the_bound_is_budget_weights_and_the_idle_baseline_less_its_weights() -> None:
    overhead = overhead_bytes(idle_rss=250 * MB, weights=MB, margin=64 * MB)
    assert overhead == 313 * MB
    assert bound_bytes(16 * MB, MB, overhead) == 330 * MB
    assert overhead_bytes(idle_rss=0, weights=MB, margin=0) == 0


def test_check_bound_counts_the_samples_over_it_per_node() -> None:
    samples = [
        Sample(1, 0, 1, 100, 2),
        Sample(2, 0, 1, 120, 2),
        Sample(1, 1, 1, 100, 2),
        Sample(2, 1, 1, 131, 2),
        Sample(3, 1, 2, 0, 0),  # restarting: no tree yet, not a sample of it
    ]
    report = check_bound(samples, {0: 130, 1: 130, 2: 130})
    assert report[0] == {"max_rss": 120, "bound": 130, "samples": 2, "over": 0, "ok": True}
    assert report[1]["over"] == 1 and not report[1]["ok"]
    assert not report[2]["ok"]  # no sample at all proves nothing


def test_the_memory_scenario_runs_with_a_budget_then_without_one() -> None:
    spec = load_scenario("routing-memory").sessions
    assert spec is not None and spec.memory_gb and spec.count == 12
    budgeted, unbounded = runs(spec)
    assert budgeted.label == "cache, budget 16 MiB" and unbounded.label == "cache, no budget"
    for run in (budgeted, unbounded):
        assert run.watch and run.kill
        assert run.up_args[run.up_args.index("--prompt-cache-disk-gb") + 1] == "1"
    assert budgeted.up_args[budgeted.up_args.index("--memory-gb") + 1] == "0.015625"
    assert unbounded.up_args[unbounded.up_args.index("--memory-gb") + 1] == "0"
    assert not any(run.watch for run in runs(load_scenario("routing").sessions))  # type: ignore[arg-type]


def test_the_table_shows_each_node_against_its_bound() -> None:
    memory = {
        "idle_rss": {0: 250 * MB, 1: 260 * MB},
        "budget": {0: 16 * MB, 1: 16 * MB},
        "weights": {0: MB, 1: MB},
        "max_rss": {0: 300 * MB, 1: 400 * MB},
        "end_rss": {0: 290 * MB, 1: 399 * MB},
        "bound": check_bound(
            [Sample(1, 0, 1, 300 * MB, 2), Sample(1, 1, 1, 400 * MB, 2)],
            {0: 330 * MB, 1: 340 * MB},
        ),
        "evictions": 40,
        "disk_writes": 41,
        "disk_loads": 9,
        "max_budget_used": 15 * MB,
    }
    result = {"requests": 144, "lost": 0, "refused_429": 0, "cached_ratio": 0.9}
    lines = render_memory({"cache": {"requests": 1}, "cache, budget": result | {"memory": memory}})
    text = "\n".join(lines)
    assert "| cache, budget | 144 | 0 | 0 | 0.900 | 0: 300 / 330, 1: 400 / 340 | **no** | 15 | 40 | 41 | 9 |" in text  # fmt: skip
    assert "| cache, budget | 1 | 16 | 1.00 | 260 | 323 | 340 | 400 | 399 | 1 of 1 |" in text
    assert render_memory({"cache": {"requests": 1}}) == []
    busy = {"cache": result | {"memory": memory | {"idle_clean": False}}}
    assert "| 260 (not idle!) |" in "\n".join(render_memory(busy))


def test_a_node_that_cached_or_wrote_anything_was_not_idle() -> None:
    assert busy_facts({"budget": 16 * MB, "weights": MB, "evictions": 0}) == 0
    assert busy_facts({"memory_tier": 1751040, "disk_writes": 1}) > 0
