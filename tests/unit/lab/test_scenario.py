"""Scenario files (TOML → validated model) and the verdict computed from probe rows."""

from __future__ import annotations

import pytest

from lab.rows import ProbeRow
from lab.scenario import (
    SCENARIO_DIR,
    FaultStep,
    NodeStep,
    PartitionStep,
    ScenarioError,
    load_scenario,
    parse_link,
    parse_scenario,
)
from lab.verdict import baseline_outputs, judge, recovery_time

MINIMAL = """
name = "x"
duration_s = 20
[[nodes]]
[[nodes]]
"""


def test_every_bundled_scenario_loads() -> None:
    names = sorted(p.stem for p in SCENARIO_DIR.glob("*.toml"))
    assert {
        "asymmetric-loss",
        "kill-restart",
        "sigstop",
        "partition-heal",
        "slow-worker",
        "join-midrun",
        "ci-loss-kill",
    } <= set(names)
    for name in names:
        scenario = load_scenario(name)
        assert scenario.name == name
        assert scenario.expect.max_hung == 0
        if scenario.sessions is not None:  # replayed sessions: python -m lab.routing_compare
            continue
        # Every bundled scenario is a fault scenario: it sets a floor and a time-to-error bound.
        assert scenario.steps and scenario.expect.min_success is not None, name
        assert scenario.expect.max_time_to_error_s <= 5, name


@pytest.mark.parametrize("name", ["kill-restart", "sigstop", "ci-loss-kill"])
def test_kill_and_stop_scenarios_probe_every_api_streamed_and_not(name: str) -> None:
    scenario = load_scenario(name)
    assert any(isinstance(s, NodeStep) and s.action in ("kill", "stop") for s in scenario.steps)
    assert scenario.probe.apis == ["chat", "responses", "messages"]
    assert scenario.probe.sentinel  # the non-stream request beside each stream


def test_asymmetric_loss_is_two_one_way_faults() -> None:
    scenario = load_scenario("asymmetric-loss")
    faults = [s for s in scenario.steps if isinstance(s, FaultStep)]
    assert [(f.directions, f.settings.loss) for f in faults] == [([(0, 1)], 0.05), ([(1, 0)], 0.30)]
    assert scenario.first_fault_at == 8 and scenario.recovery_from == 33


def test_defaults_and_model_ids() -> None:
    scenario = parse_scenario(
        MINIMAL + '[[nodes]]\nmodel = "tiny:shared"\n[[nodes]]\nmodel = "smollm2-135m"\n'
    )
    assert scenario.probe.target == 0 and scenario.probe.apis == ["chat"]
    assert [n.model_id(i) for i, n in enumerate(scenario.nodes)] == [
        "tiny-0",
        "tiny-1",
        "shared",
        "smollm2-135m",
    ]
    assert [n.is_tiny for n in scenario.nodes] == [True, True, True, False]
    assert scenario.steps == [] and scenario.first_fault_at is None


@pytest.mark.parametrize(
    ("text", "pairs"),
    [("0->1", [(0, 1)]), ("2 <- 0", [(0, 2)]), ("1<->3", [(1, 3), (3, 1)])],
)
def test_parse_link(text: str, pairs: list) -> None:
    assert parse_link(text) == pairs


@pytest.mark.parametrize("text", ["0-1", "1->1", "a->b", "0->", ""])
def test_parse_link_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_link(text)


@pytest.mark.parametrize(
    ("extra", "complaint"),
    [
        ('[[steps]]\nat = 1\naction = "kill"\nnode = 5\n', "names node 5"),
        ('[[steps]]\nat = 30\naction = "heal"\n', "after duration_s"),
        ('[[steps]]\nat = 1\naction = "explode"\n', "explode"),
        ('[[steps]]\nat = 1\naction = "fault"\nlink = "0->1"\nloss = 1.5\n', "loss"),
        ('[[steps]]\nat = 1\naction = "fault"\nlink = "0-1"\n', "bad link"),
        ('[[steps]]\nat = 1\naction = "partition"\ngroups = [[0], [0, 1]]\n', "disjoint"),
        ('[[steps]]\nat = 1\naction = "join"\nnode = 1\n', "start = false"),
        ('[[steps]]\nat = 1\naction = "slow"\nnode = 1\nduty = 0\n', "duty"),
        ('[[steps]]\nat = 5\naction = "heal"\n[[steps]]\nat = 1\naction = "heal"\n', "time order"),
        ('[[steps]]\nat = 1\naction = "kill"\nnode = 1\nsurprise = 1\n', "surprise"),
        ("[probe]\ntarget = 2\n", "probe.target"),
        ('[probe]\napis = ["smoke"]\n', "smoke"),
        ('[[steps]]\nat = 1\naction = "heal"\n', "must set expect.min_success"),
        ("[expect]\nmin_success = 1.5\n", "min_success"),
        ("[expect]\nmax_time_to_error_s = 0\n", "max_time_to_error_s"),
        ("[probe]\ntimeout_s = 5\n[expect]\nmax_time_to_error_s = 5\n", "below probe.timeout_s"),
    ],
)
def test_invalid_scenarios_say_what_is_wrong(extra: str, complaint: str) -> None:
    with pytest.raises(ScenarioError) as info:
        parse_scenario(MINIMAL + extra, "bad.toml")
    assert "bad.toml" in str(info.value) and complaint in str(info.value)


def test_late_nodes_need_a_join_and_node_zero_starts() -> None:
    with pytest.raises(ScenarioError, match="never start"):
        parse_scenario(MINIMAL + "[[nodes]]\nstart = false\n")
    with pytest.raises(ScenarioError, match="node 0"):
        parse_scenario('name = "x"\nduration_s = 5\n[[nodes]]\nstart = false\n')
    with pytest.raises(ScenarioError, match="not valid TOML"):
        parse_scenario("name = ")
    with pytest.raises(ScenarioError, match="bundled"):
        load_scenario("no-such-scenario")


def test_step_kinds_are_discriminated() -> None:
    scenario = parse_scenario(
        MINIMAL
        + '[[steps]]\nat = 1\naction = "partition"\ngroups = [[0], [1]]\n'
        + '[[steps]]\nat = 2\naction = "stop"\nnode = 1\n'
        + "[expect]\nmin_success = 0\n"
    )
    assert isinstance(scenario.steps[0], PartitionStep) and isinstance(scenario.steps[1], NodeStep)


# --- verdict -------------------------------------------------------------------------------------


def _row(t: float, outcome: str = "ok", text: str | None = "a b c", **kw) -> ProbeRow:
    return ProbeRow(
        t=t,
        url="u",
        kind="stream",
        model="tiny-1",
        api="chat",
        outcome=outcome,
        duration_s=0.1,
        text=text,
        **kw,
    )


SCENARIO = parse_scenario(
    MINIMAL
    + '[[steps]]\nat = 5\naction = "kill"\nnode = 1\n[[steps]]\nat = 10\naction = "restart"\nnode = 1\n'
    + "[expect]\nmin_success = 0\nrecover_within_s = 3\n"
)


def test_verdict_counts_compares_and_times_recovery() -> None:
    start = 1000.0
    rows = [
        _row(1000.5),
        _row(1001.0),
        _row(1002.0, text="odd"),  # baseline: "a b c" wins
        ProbeRow(t=1001.0, url="u", kind="models", model="*", outcome="ok", duration_s=0.1),
        _row(1006.0, "http_error", text=None, status=503, retry_after="1"),
        _row(1007.0, "error_event", text=None),
        _row(1008.0, "http_error", text=None, status=404),
        _row(1009.0),  # ok during the outage (another route), but not yet "recovered"
        _row(1010.5, "error_event", text=None),
        _row(1012.0, text="different"),
        _row(1013.0),
    ]
    verdict = judge(SCENARIO, rows, started_at=start)
    assert (
        verdict.sent,
        verdict.succeeded,
        verdict.failed_proper,
        verdict.failed_improper,
        verdict.hung,
    ) == (10, 6, 4, 0, 0)
    assert (verdict.identical, verdict.compared) == (2, 3)
    assert verdict.recovery_s == pytest.approx(2.0) and verdict.recovered
    assert (verdict.fault_requests, verdict.fault_ok) == (4, 1)  # [1005, 1010)
    assert verdict.passed and verdict.reasons == []
    # The same run with one of those errors a timeout and one a refused connection: fails.
    rows[6] = _row(1008.0, "timeout", text=None)
    rows[8] = _row(1010.5, "transport_error", text=None)
    broken = judge(SCENARIO, rows, started_at=start)
    assert (broken.failed_proper, broken.failed_improper) == (2, 2) and not broken.passed
    assert broken.reasons == [
        "2 improper failures: 1 timed out, 1 transport error (refused, reset or malformed)"
    ]


def test_verdict_fails_on_hung_and_on_no_recovery() -> None:
    rows = [_row(1001.0), _row(1006.0, "hung"), _row(1011.0), _row(1012.0, "timeout", text=None)]
    verdict = judge(SCENARIO, rows, started_at=1000.0)
    assert not verdict.passed and verdict.hung == 1 and not verdict.recovered
    assert any("hung" in r for r in verdict.reasons) and any(
        "recover" in r for r in verdict.reasons
    )
    slow = judge(
        SCENARIO, [_row(1001.0), _row(1006.0), _row(1011.0, "error_event"), _row(1014.5)], 1000.0
    )
    assert slow.recovery_s == pytest.approx(4.5) and not slow.passed
    assert slow.reasons == ["recovered after 4.5s (allowed 3s)"]
    assert not judge(SCENARIO, [], 1000.0).passed


def test_recovery_and_baseline_helpers() -> None:
    assert recovery_time([], 0.0) is None
    assert recovery_time([_row(5.0)], 2.0) == pytest.approx(3.0)
    assert baseline_outputs([_row(1.0), _row(2.0, "hung")], until=3.0) == {
        ("tiny-1", "chat", "stream"): "a b c"
    }


def test_faulted_pairs_are_what_a_bypass_would_void() -> None:
    assert load_scenario("kill-restart").faulted_pairs() == set()
    assert load_scenario("asymmetric-loss").faulted_pairs() == {(0, 1)}
    assert load_scenario("partition-heal").faulted_pairs() == {(0, 1), (0, 2)}


def test_verdict_phases_split_at_first_and_last_step() -> None:
    rows = [
        _row(1001.0, ttft_s=0.1),
        _row(1002.0, ttft_s=0.3),
        _row(1006.0, "timeout", text=None),
        _row(1007.0, ttft_s=2.0),
        _row(1011.0, ttft_s=0.2),
    ]
    phases = {p.phase: p for p in judge(SCENARIO, rows, started_at=1000.0).phases}
    assert list(phases) == ["before faults", "during", "after"]
    assert (phases["before faults"].requests, phases["before faults"].ok) == (2, 2)
    assert phases["before faults"].ttft_p50_s == pytest.approx(0.2)
    assert (phases["during"].requests, phases["during"].ok, phases["during"].ttft_p95_s) == (
        2,
        1,
        2.0,
    )
    assert phases["after"].ttft_p50_s == pytest.approx(0.2)
    no_steps = parse_scenario(MINIMAL)
    assert [p.phase for p in judge(no_steps, rows, 1000.0).phases] == ["whole run"]


def test_one_step_scenarios_have_no_during_phase() -> None:
    scenario = parse_scenario(
        MINIMAL + '[[steps]]\nat = 5\naction = "kill"\nnode = 1\n[expect]\nmin_success = 0\n'
    )
    phases = judge(scenario, [_row(1001.0), _row(1009.0)], 1000.0).phases
    assert [(p.phase, p.requests) for p in phases] == [("before faults", 1), ("after", 1)]


def test_suite_markdown_row() -> None:
    from lab.suite import HEADER, render

    verdict = judge(
        SCENARIO, [_row(1001.0, ttft_s=0.1), _row(1006.0, "hung"), _row(1011.0, ttft_s=0.2)], 1000.0
    )
    table = render([verdict])
    assert table.startswith(HEADER)
    row = table.splitlines()[-1]
    assert row.startswith(
        "| x | 3 | 2 | 0 | 0 | **1** | 0/1 ≥ 0% | 0.1 ≤ 5 | 1/1 | 1.0 s "
        "| 1/1 · 0.10 / 0.10 | 0/1 · – / – |"
    )
    assert "FAIL: 1 hung requests" in row


def test_gateway_only_nodes() -> None:
    scenario = parse_scenario(
        MINIMAL.replace("[[nodes]]\n[[nodes]]", '[[nodes]]\nmodel = "none"\n[[nodes]]')
    )
    assert [n.serves for n in scenario.nodes] == [False, True]


def test_mesh_outputs_are_not_compared() -> None:
    rows = [
        _row(1001.0).model_copy(update={"model": "mesh"}),
        _row(1009.0, text="another candidate won").model_copy(update={"model": "mesh"}),
    ]
    verdict = judge(SCENARIO, rows, 1000.0)
    assert (verdict.identical, verdict.compared) == (None, None)
