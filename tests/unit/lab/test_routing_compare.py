"""lab.routing_compare's pure parts: the replayed sessions and the summary."""

from __future__ import annotations

import itertools
import json

from lab.routing_compare import FIXTURE, Turn, build_sessions, ceiling, runs, summarize
from lab.scenario import load_scenario


def test_sessions_share_the_system_prompt_and_nothing_after_it():
    sessions = build_sessions(3, json.loads(FIXTURE.read_text()))
    assert all(len(turns) >= 10 for turns in sessions)  # the issue asks for >= 10 turns
    firsts = [turns[0] for turns in sessions]
    assert len({json.dumps([t["system"], t["tools"]]) for t in firsts}) == 1
    assert len({t["messages"][0]["content"] for t in firsts}) == 3
    for turns in sessions:  # each turn extends the last: a cache can serve the previous one
        for before, after in itertools.pairwise(turns):
            assert after["messages"][: len(before["messages"])] == before["messages"]
            assert after["messages"][-1]["role"] != "assistant"


def test_summary_counts_cached_tokens_as_part_of_the_prompt():
    """Anthropic usage: input_tokens are the uncached part."""
    turns = [
        Turn(
            0,
            0,
            0,
            ok=True,
            ttft_s=1.0,
            input_tokens=100,
            cached_tokens=300,
            reason="cache 300/400",
            attempts=1,
        ),
        Turn(0, 1, 1, ok=False, attempts=2),
    ]
    summary = summarize(turns)
    assert summary["cached_ratio"] == 0.75 and summary["prefill_tokens"] == 100
    assert summary["lost"] == 1 and summary["client_retries"] == 1
    assert summary["reasons"] == {"cache": 1}


def test_the_ceiling_is_each_turns_previous_prompt_and_the_shared_prefix():
    def turn(session: int, number: int, prompt: int, cached: int) -> Turn:
        return Turn(session, number, 0, ok=True, input_tokens=prompt - cached, cached_tokens=cached)

    turns = [
        turn(0, 1, 300, 0),  # out of order: its session's turns are taken by number
        turn(0, 0, 200, 0),
        turn(1, 0, 210, 50),  # the prefix all first turns share: 50
        turn(1, 1, 320, 320),  # cannot have found more than its previous prompt
    ]
    assert ceiling(turns) == (50 + 200 + 50 + 210) / (200 + 300 + 210 + 320)
    assert ceiling([]) == 0.0


def test_the_routing_scenario_compares_three_modes_then_hedges():
    spec = load_scenario("routing").sessions
    assert spec is not None and spec.count == 12
    plan = runs(spec)
    labels = [run.label for run in plan]
    assert labels[:3] == ["today", "round-robin", "cache"]
    assert labels[3:5] == ["today, no session key", "cache, no session key"]
    assert [run.session_keys for run in plan[:5]] == [True, True, True, False, False]
    assert labels[5:] == ["cache, hedge auto, healthy", "cache, hedge off, node 1 slowed", "cache, hedge auto, node 1 slowed"]  # fmt: skip
    assert [(run.kill, run.slow) for run in plan[5:]] == [(False, False), (False, True), (False, True)]  # fmt: skip


def test_the_small_cache_scenario_gives_every_run_its_cache_size():
    spec = load_scenario("routing-small-cache").sessions
    assert spec is not None and spec.prompt_cache_gb == 0.005
    plan = runs(spec)
    assert [run.label for run in plan][-2:] == ["today, no session key", "cache, no session key"]
    for run in plan:
        assert run.up_args[run.up_args.index("--prompt-cache-gb") + 1] == "0.005"
    assert "--prompt-cache-gb" not in runs(load_scenario("routing").sessions)[0].up_args
