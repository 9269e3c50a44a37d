"""The MoA arbiter as a pure object: events and made-up clock readings in, decisions out."""

from __future__ import annotations

import dataclasses

import pytest

from gateway.moa.arbiter import REDUCER, Arbiter, ArbiterState
from gateway.moa.config import MoaConfig
from gateway.moa.events import (
    Cancel,
    Commit,
    Fail,
    StartReducer,
    TokenArrived,
    WorkerFailed,
    WorkerFinished,
    WorkerStarted,
)

# N-token race semantics (early commit has its own tests below).
CONFIG = MoaConfig(
    race_min_tokens=3,
    race_early_commit=False,
    grace_s=1.0,
    first_token_timeout_s=5.0,
    total_timeout_s=60.0,
)


def make(policy: str, workers=("a", "b", "c"), **overrides) -> Arbiter:
    config = dataclasses.replace(CONFIG, **overrides)
    arbiter = Arbiter(list(workers), config, now=0.0, policy=policy)  # type: ignore[arg-type]
    for w in workers:
        assert arbiter.handle(WorkerStarted(w), 0.0) == []
    return arbiter


def feed(arbiter: Arbiter, worker: str, pieces, start: float, step: float = 0.1, **kw):
    """Feed text pieces at start, start+step, …; returns every decision made on the way."""
    out = []
    for i, piece in enumerate(pieces):
        out += arbiter.handle(TokenArrived(worker, piece, **kw), start + i * step)
    return out


def commits(decisions):
    return [d for d in decisions if isinstance(d, Commit)]


def cancels(decisions):
    return {d.worker for d in decisions if isinstance(d, Cancel)}


# -- race -------------------------------------------------------------------------------------


def test_race_commits_to_first_worker_with_n_passing_tokens_and_cancels_the_rest():
    arbiter = make("race")
    assert feed(arbiter, "b", ["The", " sky"], start=0.1) == []
    assert feed(arbiter, "a", ["It", " is"], start=0.15) == []
    decisions = arbiter.handle(TokenArrived("b", " is"), 0.3)
    assert commits(decisions) == [Commit("b", "race")]
    assert cancels(decisions) == {"a", "c"}
    assert arbiter.state is ArbiterState.COMMITTED and arbiter.winner == "b"
    # After the decision the arbiter is deaf.
    assert arbiter.handle(TokenArrived("a", " x"), 0.4) == []
    assert arbiter.next_deadline() is None


def test_race_skips_leaked_think_markup():
    arbiter = make("race")
    assert feed(arbiter, "a", ["<think>", "hmm", " ok"], start=0.1) == []
    decisions = feed(arbiter, "b", ["Blue", " sky", " today"], start=0.2)
    assert commits(decisions) == [Commit("b", "race")]
    assert "a" in cancels(decisions)


def test_race_skips_repetition_loop():
    arbiter = make("race")
    assert feed(arbiter, "a", ["the cat " * 3, "the cat " * 3, "the cat " * 3], start=0.1) == []
    assert commits(feed(arbiter, "b", ["A", " fine", " answer"], start=0.5)) == [
        Commit("b", "race")
    ]


def test_race_holds_a_refusal_while_others_answer():
    arbiter = make("race")
    assert feed(arbiter, "a", ["I'm", " sorry", ", I can't"], start=0.1) == []
    assert commits(feed(arbiter, "b", ["Paris", " is", " the capital"], start=0.5)) == [
        Commit("b", "race")
    ]


def test_race_commits_a_refusal_when_nobody_else_answers():
    arbiter = make("race", workers=("a", "b"))
    assert feed(arbiter, "a", ["I", " cannot", " help"], start=0.1) == []
    decisions = arbiter.handle(WorkerFailed("b", "boom"), 0.5)
    assert commits(decisions) == [Commit("a", "survivor")]


def test_race_falls_back_to_the_least_bad_stream_when_all_are_settled_failing():
    arbiter = make("race", workers=("a", "b"))
    feed(arbiter, "a", ["I'm", " sorry", " no"], start=0.1)
    assert feed(arbiter, "b", ["<think>", "x"], start=0.1) == []
    # Now both streams are settled (a refusal and leaked markup do not go away): a refusal is
    # the better of the two.
    decisions = arbiter.handle(TokenArrived("b", "y"), 0.5)
    assert commits(decisions) == [Commit("a", "fallback")]


def test_race_short_complete_answer_commits_before_n_tokens():
    arbiter = make("race")
    feed(arbiter, "c", ["42"], start=0.1)
    assert commits(arbiter.handle(WorkerFinished("c"), 0.2)) == [Commit("c", "race")]


def test_race_empty_answer_is_not_committed_while_others_may_answer():
    arbiter = make("race", workers=("a", "b"))
    arbiter.handle(WorkerFinished("a"), 0.1)  # finished with nothing
    assert arbiter.state is ArbiterState.WATCHING
    assert commits(feed(arbiter, "b", ["x", "y", "z"], start=0.2)) == [Commit("b", "race")]


def test_race_early_commit_takes_a_conclusive_opening_at_once():
    arbiter = make("race", race_early_commit=True, race_min_tokens=8)
    assert arbiter.handle(TokenArrived("a", "I"), 0.1) == []  # might become "I'm sorry"
    assert arbiter.handle(TokenArrived("b", "<thi"), 0.1) == []  # might become markup
    assert arbiter.handle(TokenArrived("c", " "), 0.1) == []  # nothing yet
    decisions = arbiter.handle(TokenArrived("c", "The"), 0.2)
    assert commits(decisions) == [Commit("c", "race")]
    assert cancels(decisions) == {"a", "b"}


def test_race_early_commit_still_skips_refusals_and_markup():
    arbiter = make("race", race_early_commit=True, race_min_tokens=8)
    assert feed(arbiter, "a", ["I", "'m", " sorry"], start=0.1) == []
    assert arbiter.handle(TokenArrived("b", "<think>"), 0.2) == []
    assert commits(arbiter.handle(TokenArrived("c", "I think it is 4"), 0.3)) == [
        Commit("c", "race")
    ]


def test_reasoning_and_tool_calls_count_as_output():
    arbiter = make("race", workers=("a", "b"))
    decisions = feed(arbiter, "a", ["Let", " me", " see"], start=0.1, channel="reasoning")
    assert commits(decisions) == [Commit("a", "race")]
    arbiter = make("race", workers=("a", "b"))
    decisions = feed(arbiter, "b", ['{"c', 'ity"', ": 1}"], start=0.1, channel="tool")
    assert commits(decisions) == [Commit("b", "race")]


# -- deadlines and failures (all policies) ------------------------------------------------


@pytest.mark.parametrize("policy", ["race", "consensus", "reduce"])
def test_first_token_deadline_fails_a_silent_worker(policy):
    arbiter = make(policy, workers=("a", "b"), grace_s=100.0)
    assert arbiter.next_deadline() == pytest.approx(5.0)
    arbiter.handle(TokenArrived("a", "x"), 1.0)
    assert arbiter.tick(4.9) == []
    decisions = arbiter.tick(5.0)
    assert Cancel("b") in decisions
    assert commits(decisions) == [Commit("a", "survivor")]


@pytest.mark.parametrize("policy", ["race", "consensus", "reduce"])
def test_the_last_survivor_is_passed_through(policy):
    arbiter = make(policy)
    assert arbiter.handle(WorkerFailed("a", "upstream: boom"), 0.1) == []
    # Silent, c could still miss its first-token deadline: it is committed once it streams.
    assert arbiter.handle(WorkerFailed("b", "raised"), 0.2) == []
    assert arbiter.next_deadline() == pytest.approx(5.0)
    assert arbiter.handle(TokenArrived("c", "x"), 0.3) == [Commit("c", "survivor")]


def test_a_silent_survivor_that_misses_its_deadline_fails_the_request():
    arbiter = make("race", workers=("a", "b"))
    assert arbiter.handle(WorkerFailed("a", "upstream: boom"), 0.1) == []
    decisions = arbiter.tick(5.0)
    assert Cancel("b") in decisions and [d.kind for d in decisions if isinstance(d, Fail)] == [
        "upstream"
    ]


def test_all_timed_out_fails_with_timeout():
    arbiter = make("race", workers=("a", "b"))
    decisions = arbiter.tick(5.0)
    assert cancels(decisions) == {"a", "b"}
    fails = [d for d in decisions if isinstance(d, Fail)]
    assert fails and fails[0].kind == "timeout"


def test_total_deadline_fails_a_worker_that_never_finishes():
    arbiter = make("consensus", workers=("a", "b"), total_timeout_s=10.0, grace_s=100.0)
    feed(arbiter, "a", ["x"], start=0.1)
    feed(arbiter, "b", ["y"], start=0.1)
    assert arbiter.next_deadline() == pytest.approx(10.0)
    arbiter.handle(WorkerFinished("b"), 2.0)
    decisions = arbiter.tick(10.0)
    assert Cancel("a") in decisions and commits(decisions) == [Commit("b", "survivor")]


def test_single_worker_is_committed_at_once():
    arbiter = Arbiter(["only"], CONFIG, now=0.0, policy="consensus")
    assert commits(arbiter.handle(WorkerStarted("only"), 0.0)) == [Commit("only", "single")]


def test_unknown_worker_events_are_ignored():
    arbiter = make("race")
    assert arbiter.handle(TokenArrived("zzz", "x"), 0.1) == []


# -- consensus --------------------------------------------------------------------------------


def test_consensus_commits_when_finished_answers_agree():
    arbiter = make("consensus", grace_s=100.0)
    feed(arbiter, "a", ["**42**."], start=0.1)
    feed(arbiter, "b", ["41"], start=0.1)
    arbiter.handle(WorkerFinished("a"), 0.2)
    assert arbiter.handle(WorkerFinished("b"), 0.3) == []
    feed(arbiter, "c", ["42"], start=0.4)
    decisions = arbiter.handle(WorkerFinished("c"), 0.5)
    assert [d.worker for d in commits(decisions)] in (["a"], ["c"])
    assert commits(decisions)[0].reason == "agreement"


def test_consensus_commits_on_prefix_agreement_while_streaming():
    arbiter = make("consensus", grace_s=100.0, agree_prefix_chars=12)
    feed(arbiter, "a", ["The capital", " of France"], start=0.1)
    assert feed(arbiter, "b", ["A city"], start=0.1) == []
    decisions = feed(arbiter, "c", ["The capital ", "is"], start=0.2)
    assert [d.reason for d in commits(decisions)] == ["agreement"]
    assert commits(decisions)[0].worker in ("a", "c")
    assert "b" in cancels(decisions)


def test_consensus_grace_deadline_picks_the_best_logprob():
    arbiter = make("consensus", grace_s=1.0)
    feed(arbiter, "a", ["Alpha", " one"], start=0.5, logprob=-2.0)
    feed(arbiter, "b", ["Beta", " two"], start=0.6, logprob=-0.1)
    assert arbiter.next_deadline() == pytest.approx(1.5)
    assert arbiter.tick(1.4) == []
    decisions = arbiter.tick(1.5)
    assert commits(decisions) == [Commit("b", "grace")]
    assert cancels(decisions) == {"a", "c"}


def test_consensus_grace_prefers_a_passing_stream_over_leaked_markup():
    arbiter = make("consensus", grace_s=1.0)
    feed(arbiter, "a", ["<think>", "x"], start=0.5, logprob=-0.01)
    feed(arbiter, "b", ["Fine"], start=0.6, logprob=-3.0)
    assert commits(arbiter.tick(1.5)) == [Commit("b", "grace")]


def test_consensus_win_rate_breaks_ties():
    config = MoaConfig(policy="consensus", grace_s=1.0)
    arbiter = Arbiter(["a", "b"], config, now=0.0, win_rates={"a": 0.2, "b": 0.9})
    feed(arbiter, "a", ["Alpha"], start=0.5)
    feed(arbiter, "b", ["Beta"], start=0.5)
    assert commits(arbiter.tick(1.5)) == [Commit("b", "grace")]


def test_consensus_commits_when_all_are_complete():
    arbiter = make("consensus", workers=("a", "b"), grace_s=100.0)
    feed(arbiter, "a", ["One"], start=0.1)
    feed(arbiter, "b", ["Two"], start=0.1)
    arbiter.handle(WorkerFinished("a"), 0.2)
    assert commits(arbiter.handle(WorkerFinished("b"), 0.3))[0].reason == "complete"


def test_consensus_waits_past_grace_until_someone_has_output():
    arbiter = make("consensus", workers=("a", "b"))
    assert arbiter.grace_deadline() is None
    assert arbiter.tick(3.0) == []


# -- reduce -------------------------------------------------------------------------------------


def test_reduce_starts_the_reducer_once_k_answers_are_in():
    arbiter = make("reduce", grace_s=100.0)  # k = majority of 3 = 2
    feed(arbiter, "a", ["Paris"], start=0.1)
    arbiter.handle(WorkerFinished("a"), 0.2)
    feed(arbiter, "c", ["Still", " going"], start=0.2)
    feed(arbiter, "b", ["Lyon"], start=0.3)
    decisions = arbiter.handle(WorkerFinished("b"), 0.4)
    starts = [d for d in decisions if isinstance(d, StartReducer)]
    assert len(starts) == 1
    assert dict(starts[0].answers) == {"a": "Paris", "b": "Lyon"}
    assert starts[0].fallback in ("a", "b")
    assert cancels(decisions) == {"c"}
    assert arbiter.state is ArbiterState.REDUCING
    # The reducer's first token commits it.
    assert arbiter.handle(TokenArrived("c", "late"), 0.5) == []
    assert commits(arbiter.handle(TokenArrived(REDUCER, "Paris"), 0.9)) == [
        Commit(REDUCER, "reduced")
    ]


def test_reduce_skips_the_reducer_when_answers_agree():
    arbiter = make("reduce", grace_s=100.0)
    for w in ("a", "b"):
        feed(arbiter, w, ["Paris."], start=0.1)
    arbiter.handle(WorkerFinished("a"), 0.2)
    decisions = arbiter.handle(WorkerFinished("b"), 0.3)
    assert [d.reason for d in commits(decisions)] == ["unanimous"]
    assert cancels(decisions) == {"c"}


@pytest.mark.parametrize("how", ["fails", "times out", "says nothing"])
def test_reduce_falls_back_to_the_best_answer_when_the_reducer_fails(how):
    arbiter = make("reduce", workers=("a", "b"), grace_s=100.0)
    feed(arbiter, "a", ["Paris"], start=0.1, logprob=-0.1)
    feed(arbiter, "b", ["Lyon"], start=0.1, logprob=-3.0)
    arbiter.handle(WorkerFinished("a"), 0.2)
    decisions = arbiter.handle(WorkerFinished("b"), 0.3)
    assert any(isinstance(d, StartReducer) for d in decisions)
    if how == "fails":
        decisions = arbiter.handle(WorkerFailed(REDUCER, "boom"), 1.0)
    elif how == "times out":
        assert arbiter.next_deadline() == pytest.approx(0.3 + CONFIG.first_token_timeout_s)
        decisions = arbiter.tick(0.3 + CONFIG.first_token_timeout_s)
    else:
        decisions = arbiter.handle(WorkerFinished(REDUCER), 1.0)
    assert commits(decisions) == [Commit("a", "reducer-failed")]


def test_reduce_grace_with_one_answer_commits_it():
    arbiter = make("reduce", grace_s=1.0)
    feed(arbiter, "a", ["Paris"], start=0.1)
    arbiter.handle(WorkerFinished("a"), 0.2)
    feed(arbiter, "b", ["Still"], start=0.2)
    assert arbiter.tick(1.0) == []
    decisions = arbiter.tick(1.1)
    assert commits(decisions) == [Commit("a", "grace")]
    assert cancels(decisions) == {"b", "c"}


@pytest.mark.parametrize("policy", ["consensus", "reduce"])
def test_a_passed_grace_deadline_is_not_reported_again(policy):
    """After the grace period, with nothing yet to decide on, the next wake-up is a real
    deadline in the future (no busy loop); the next event that allows a decision makes it."""
    arbiter = make(policy, grace_s=1.0)
    feed(arbiter, "a", ["Still", " thinking"], start=0.5)
    feed(arbiter, "b", ["Also", " going"], start=0.5)
    arbiter.handle(WorkerFailed("c", "boom"), 0.6)
    decisions = arbiter.tick(1.5)
    if policy == "consensus":  # commits to the best stream with output
        assert commits(decisions)[0].reason == "grace"
        return
    assert decisions == []  # reduce needs a complete answer
    assert arbiter.next_deadline() > 1.5
    decisions = arbiter.handle(WorkerFinished("a"), 3.0)
    assert commits(decisions) == [Commit("a", "grace")]
    assert cancels(decisions) == {"b"}


def test_consensus_after_grace_commits_to_the_first_output():
    arbiter = make("consensus", grace_s=1.0)
    feed(arbiter, "a", ["x"], start=0.1)
    arbiter.handle(WorkerFailed("a", "died"), 0.2)
    assert arbiter.tick(1.1) == []
    assert arbiter.next_deadline() == pytest.approx(5.0)  # b and c's first-token deadline
    assert commits(arbiter.handle(TokenArrived("b", "Hello"), 2.0)) == [Commit("b", "grace")]


# -- race: the preferred (caller's-temperature) sample --------------------------------------------

WINDOW = 0.075


def preferring(preferred: str = "a", **overrides) -> Arbiter:
    config = dataclasses.replace(CONFIG, **({"race_prefer_window_s": WINDOW} | overrides))
    arbiter = Arbiter(["a", "b", "c"], config, now=0.0, policy="race", preferred=preferred)
    for w in ("a", "b", "c"):
        arbiter.handle(WorkerStarted(w), 0.0)
    return arbiter


def test_race_waits_briefly_for_the_preferred_sample_and_takes_it():
    arbiter = preferring()
    assert feed(arbiter, "a", ["The", " sky"], start=0.1) == []
    assert feed(arbiter, "b", ["It", " is", " blue"], start=0.05) == []  # passes at 0.25
    decisions = arbiter.handle(TokenArrived("a", " is"), 0.3)
    assert commits(decisions) == [Commit("a", "race")] and cancels(decisions) == {"b", "c"}


def test_race_takes_the_first_passer_when_the_preferred_sample_stays_silent():
    arbiter = preferring()
    assert feed(arbiter, "b", ["It", " is", " blue"], start=0.05) == []
    assert arbiter.tick(0.25 + WINDOW / 2) == []
    decisions = arbiter.tick(0.25 + WINDOW)
    assert commits(decisions) == [Commit("b", "race")] and cancels(decisions) == {"a", "c"}


def test_race_waits_for_the_preferred_sample_in_proportion_to_the_time_to_first_token():
    """Samples admitted one prefill apart: after a 6 s prefill the caller's own sample may lag
    by 0.4 s, far beyond the fixed window, and still wins (a quarter of 6 s is 1.5 s)."""
    arbiter = preferring(first_token_timeout_s=60.0)
    assert feed(arbiter, "b", ["The", " sky", " is"], start=6.0) == []  # passes at 6.2
    assert arbiter.next_deadline() == pytest.approx(6.2 + 0.25 * 6.0)
    decisions = feed(arbiter, "a", ["The", " sky", " is"], start=6.4)
    assert commits(decisions) == [Commit("a", "race")]
    late = preferring(first_token_timeout_s=60.0)
    feed(late, "b", ["The", " sky", " is"], start=6.0)
    assert late.tick(7.6) == []
    assert commits(late.tick(7.7)) == [Commit("b", "race")]


def test_race_waits_for_a_streaming_preferred_sample_past_the_window():
    """Another sample's conclusive first word ("Yes") does not beat the caller's own sample,
    which streams at the same pace but needs N tokens to be judged."""
    arbiter = preferring(race_min_tokens=3)
    assert feed(arbiter, "b", ["Yes"], start=0.1) == []  # conclusive: b passes at once
    assert feed(arbiter, "a", ["I"], start=0.1) == []  # could still become a refusal
    assert arbiter.tick(0.1 + 10 * WINDOW) == []
    assert arbiter.handle(TokenArrived("a", " think"), 1.0) == []
    decisions = arbiter.handle(TokenArrived("a", " so"), 1.1)
    assert commits(decisions) == [Commit("a", "race")] and cancels(decisions) == {"b", "c"}


def test_race_takes_another_sample_when_the_preferred_one_is_judged_a_refusal():
    arbiter = preferring(race_min_tokens=3)
    feed(arbiter, "b", ["Yes", ",", " blue"], start=0.1)
    feed(arbiter, "a", ["I", " cannot"], start=0.1)
    decisions = arbiter.handle(TokenArrived("a", " help"), 0.5)
    assert commits(decisions) == [Commit("b", "race")]


def test_race_does_not_wait_for_a_preferred_sample_that_cannot_pass():
    arbiter = preferring()
    feed(arbiter, "b", ["It", " is"], start=0.05)
    arbiter.handle(WorkerFailed("a", "boom"), 0.2)
    assert commits(arbiter.handle(TokenArrived("b", " blue"), 0.25)) == [Commit("b", "race")]
    finished = preferring()
    feed(finished, "a", ["<think>"], start=0.01)
    finished.handle(WorkerFinished("a", "stop"), 0.02)  # complete, and leaked markup
    assert commits(feed(finished, "b", ["It", " is", " blue"], start=0.05)) == [Commit("b", "race")]


def test_race_commits_the_preferred_sample_at_once_when_it_passes_first():
    arbiter = preferring()
    feed(arbiter, "b", ["It", " is"], start=0.05)
    assert commits(feed(arbiter, "a", ["The", " sky", " is"], start=0.1)) == [Commit("a", "race")]


def test_race_without_a_preferred_worker_or_with_no_window_commits_the_first_passer():
    for arbiter in (make("race"), preferring(race_prefer_window_s=0.0)):
        feed(arbiter, "a", ["The"], start=0.1)
        assert commits(feed(arbiter, "b", ["It", " is", " blue"], start=0.05)) == [
            Commit("b", "race")
        ]
