"""The vote policy's pure pieces: answer extraction, the tally's stopping rules, and the arbiter
running ``vote`` over scripted candidate streams."""

from __future__ import annotations

import dataclasses
import random

import pytest

from gateway.moa.answers import extract_answer, states_false_equation
from gateway.moa.arbiter import Arbiter, ArbiterState
from gateway.moa.config import MoaConfig
from gateway.moa.events import (
    Cancel,
    Commit,
    TokenArrived,
    WorkerFailed,
    WorkerFinished,
    WorkerStarted,
)
from gateway.moa.views import WorkerStatus, WorkerView
from gateway.moa.vote import Tally, beta_leads, read_ballots

# -- answers ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("42", "42"),
        ("**42**.", "42"),
        ("1,000.50", "1000.5"),
        ("-0", "0"),
        ("4.0", "4"),
        ("3 + 4 = 7", "7"),
        ("The answer is 12.", "12"),
        ("First 3 apples, then 5 more, so the total is 8 apples in the basket.", "8"),
        ("Let me think. 2 and 3. Final answer: 5", "5"),
        ("so \\boxed{17}", "17"),
        ("(B)", "b"),
        ("B) Paris", "b"),
        ("Answer: C", "c"),
        ("Paris.", "paris"),
        ("  The Eiffel Tower  ", "the eiffel tower"),
        ("Here:\n```python\ndef f():   \n    return 1\n```\n", "def f():\n    return 1"),
    ],
)
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


@pytest.mark.parametrize(
    "variants",
    [
        ['The answer is "True".', "True", "the answer is true", "**True**", "answer: (True)."],
        ["The answer is 4.37271e+02", "437.271", "The answer is 437.2710", "4.37271E2"],
        ["1e3", "The answer is 1,000", "1000.0"],
        ["'yes'!", "Yes.", "\u201cyes\u201d"],
    ],
)
def test_one_answer_written_many_ways_votes_as_one(variants):
    """A quote or period after the answer, or e-notation, split the tally (48 of 408 tallies on
    held-out families held such a split)."""
    assert len({extract_answer(text) for text in variants}) == 1


def test_a_huge_exponent_is_not_written_out():
    assert extract_answer("The answer is 1e999999") == "1e999999"


def test_a_bracket_that_belongs_to_the_answer_stays():
    assert extract_answer("The answer is f(x)") == "f(x)"


@pytest.mark.parametrize(
    "text",
    [
        "",
        "   ",
        "Once upon a time there was a little fox who lived in the woods and loved berries.",
    ],
)
def test_open_ended_or_empty_text_has_no_answer(text):
    assert extract_answer(text) is None


@pytest.mark.parametrize(
    ("text", "false"),
    [
        ("10 + 9 = 10\n\nThe answer is 10.", True),
        ("6 * 7 = 43", True),
        ("12 - 3 - 4 = 6", True),
        ("10/3 = 3.4", True),
        ("10 + 9 = 19", False),
        ("6 × 7 = 42", False),
        ("3 - 5 = -2", False),
        ("10 / 3 = 3.33", False),  # rounded, not false
        ("0.5 * 4 = 2.0", False),
        ("2^3 + 1 = 9", False),  # a power it does not read is not checked
        ("x + 3 = 5", False),
        ("4 / 0 = 0", False),
        ("The war lasted 1939-1945 = six years", False),
        ("5 = 5", False),
    ],
)
def test_a_false_equation_is_found_and_a_true_or_unreadable_one_is_not(text, false):
    assert states_false_equation(text) is false


# -- tally ------------------------------------------------------------------------------------


def test_beta_rule_values():
    assert beta_leads(0, 0) == pytest.approx(0.5)
    assert beta_leads(3, 0) == pytest.approx(15 / 16)  # below 95 %
    assert beta_leads(4, 0) == pytest.approx(31 / 32)  # above
    assert beta_leads(5, 1) < 0.95 < beta_leads(6, 1)


def test_safe_exactly_when_the_runner_up_cannot_catch_up_not_one_vote_earlier():
    tally = Tally([f"w{i}" for i in range(5)], confidence=1.0)  # Beta rule off
    tally.cast("w0", "7", -0.1)
    tally.cast("w1", "7", -0.1)
    assert tally.decision() is None  # 2 vs 0 with 3 left
    tally.cast("w2", "8", -0.1)
    assert tally.decision() is None  # 2 vs 1 with 2 left
    tally.cast("w3", "7", -0.1)
    assert tally.decision() == "safe"  # 3 vs 1 with 1 left: the best "8" can do is 2


def test_safe_needs_a_strict_lead_a_reachable_tie_is_not_safe():
    tally = Tally(["a", "b", "c", "d"], confidence=1.0)
    tally.cast("a", "x", None)
    tally.cast("b", "x", None)
    assert tally.remaining == 2 and tally.decision() is None  # 2 vs 0, two left: 2:2 possible
    tally.cast("c", "x", None)
    assert tally.decision() == "safe"


def test_beta_rule_stops_four_unanimous_votes_of_eight():
    tally = Tally([f"w{i}" for i in range(8)])
    for i in range(3):
        tally.cast(f"w{i}", "5", -0.2)
        assert tally.decision() is None
    tally.cast("w3", "5", -0.2)
    assert tally.decision() == "confident"


def test_scattered_answers_stop_the_vote_once_half_are_in_and_the_caller_s_answer_stands():
    tally = Tally(names(8), preferred="w0", scatter=1 / 3)
    for i, answer in enumerate(["1", "2", "3"]):
        tally.cast(f"w{i}", answer, -0.1 * (3 - i))  # the caller's own is the least confident
    assert tally.decision() is None  # three of eight: not half yet
    tally.cast("w3", None, None)  # an abstention counts as in: half, and no answer has two
    assert tally.decision() == "scattered" and tally.winner().candidate == "w0"


def test_a_leader_with_more_than_the_scatter_share_keeps_the_vote_open():
    tally = Tally(names(8), scatter=1 / 3)
    for i, answer in enumerate(["1", "1", "2", "3"]):
        tally.cast(f"w{i}", answer, None)
    assert tally.decision() is None  # "1" has half of the four
    tally.cast("w4", "4", None)
    tally.cast("w5", "5", None)
    assert tally.decision() == "scattered"  # two of six: a third
    assert Tally(names(8)).scatter is None  # off unless asked (the arbiter passes MoaConfig's)


def test_abstentions_and_withdrawals_only_shrink_the_remaining_count():
    tally = Tally(["a", "b", "c"], confidence=1.0)
    tally.cast("a", "5", -0.1)
    tally.cast("b", None, -0.1)
    assert tally.decision() is None  # 1 vs 0 with one left
    tally.withdraw("c")
    assert tally.decision() == "complete"
    assert tally.votes() == {"5": 1} and tally.abstained == ["b"] and tally.withdrawn == ["c"]
    assert tally.winner().candidate == "a"


def test_needed_is_the_fewest_votes_for_the_leader_that_decide():
    tally = Tally(names(8))
    assert tally.needed() == 4  # 4 : 0 is the first confident count (0.97)
    for i, answer in enumerate(["5", "5", "6", "7"]):
        tally.cast(f"w{i}", answer, None)
    assert tally.needed() == 2  # 4 : 1 with 2 left is safe; 3 : 1 with 3 left is neither
    tally = Tally(names(3))
    tally.cast("w0", "1", None)
    tally.cast("w1", "2", None)
    assert tally.needed() == 1  # the last vote breaks the tie: complete either way


def test_winner_is_the_majority_answers_most_confident_candidate():
    tally = Tally(["a", "b", "c", "d"])
    tally.cast("a", "7", -0.05)  # most confident overall, but the minority
    tally.cast("b", "8", -0.9)
    tally.cast("c", "8", -0.3)
    tally.cast("d", "8", None)
    assert tally.winner().candidate == "c"


# Two answers, two votes each: "2"'s voters are the more confident, "1" has the first candidate.
TIED = (("a", "1", -0.5), ("b", "2", -0.2), ("c", "1", -0.6), ("d", "2", -0.1))


def cast_all(tally, ballots):
    for name, answer, lp in ballots:
        tally.cast(name, answer, lp)
    return tally


def test_a_tie_goes_to_the_answer_whose_voters_are_more_confident():
    tally = cast_all(Tally(["a", "b", "c", "d"]), TIED)
    assert tally.decision() == "complete"
    assert tally.winner().candidate == "d"


def test_a_tie_goes_to_the_preferred_candidates_answer_whatever_the_confidence():
    tally = cast_all(Tally(["a", "b", "c", "d"], preferred="a"), TIED)
    assert tally.winner().candidate == "a"
    # Outnumbered, the preferred answer loses.
    outvoted = (("a", "1", -0.1), ("b", "2", -0.1), ("c", "2", -0.1))
    tally = cast_all(Tally(["a", "b", "c"], preferred="a"), outvoted)
    assert tally.winner().candidate == "b"


def test_a_tie_without_the_preferred_answer_goes_to_confidence():
    ballots = (
        ("a", "1", -0.1),
        ("b", "2", -0.5),
        ("c", "3", -0.2),
        ("d", "2", -0.5),
        ("e", "3", -0.2),
    )
    tally = cast_all(Tally(["a", "b", "c", "d", "e"], preferred="a"), ballots)
    # 3 (mean -0.2) beats 2 (mean -0.5); within it, equal confidence: the first to vote.
    assert tally.winner().candidate == "c"


def test_nobody_voted_means_no_winner():
    tally = Tally(["a", "b"])
    tally.cast("a", None, -0.1)
    tally.withdraw("b")
    assert tally.decision() == "complete" and tally.winner() is None


# -- the arbiter's vote policy ----------------------------------------------------------------

# The Beta rule at 0.95 (four unanimous votes), as these cases were worked out; the default is
# tuned on the benchmark (gateway/moa/config.py).
CONFIG = MoaConfig(first_token_timeout_s=5.0, total_timeout_s=60.0, vote_confidence=0.95)


def make(workers, **overrides) -> Arbiter:
    config = dataclasses.replace(CONFIG, **overrides)
    arbiter = Arbiter(list(workers), config, now=0.0, policy="vote")
    for w in workers:
        assert arbiter.handle(WorkerStarted(w), 0.0) == []
    return arbiter


def answer(arbiter, worker, text, now, logprob=-0.1, finish="stop"):
    """A whole candidate stream: its text token by token, then its end."""
    out = []
    for piece in text.split(" "):
        out += arbiter.handle(TokenArrived(worker, piece + " ", logprob=logprob), now)
    return out + arbiter.handle(WorkerFinished(worker, finish), now)


def names(n):
    return [f"w{i}" for i in range(n)]


def test_vote_stops_the_rest_as_soon_as_the_beta_rule_is_confident():
    arbiter = make(names(8))
    for i in range(3):
        assert answer(arbiter, f"w{i}", "The answer is 12", now=1.0 + i) == []
    decisions = answer(arbiter, "w3", "12", now=4.0)
    assert decisions[0] == Commit("w0", "confident")  # ties in confidence: the first voter
    assert {d.worker for d in decisions if isinstance(d, Cancel)} == {f"w{i}" for i in range(4, 8)}
    assert arbiter.stopped_early == 4 and arbiter.tally.votes() == {"12": 4}


def test_vote_commits_exactly_when_the_leader_is_safe_not_one_sample_earlier():
    arbiter = make(names(5), vote_confidence=1.0)
    assert answer(arbiter, "w0", "7", 1.0) == []
    assert answer(arbiter, "w1", "8", 1.1) == []
    assert answer(arbiter, "w2", "7", 1.2) == []  # 2 vs 1 with 2 left: not safe
    decisions = answer(arbiter, "w3", "7", 1.3, logprob=-0.01)
    assert decisions == [Commit("w3", "safe"), Cancel("w4")]
    assert arbiter.state is ArbiterState.COMMITTED


def test_vote_winner_is_the_most_confident_in_the_majority():
    arbiter = make(names(3))
    answer(arbiter, "w0", "41", 1.0, logprob=-0.01)
    answer(arbiter, "w1", "42", 1.1, logprob=-0.8)
    decisions = answer(arbiter, "w2", "42", 1.2, logprob=-0.3)
    assert decisions == [Commit("w2", "complete")]


def test_a_tie_at_the_end_goes_to_the_callers_own_answer():
    arbiter = make(names(4))
    answer(arbiter, "w0", "A", 1.0, logprob=-0.5)  # the caller's own request
    answer(arbiter, "w1", "B", 1.0, logprob=-0.2)
    answer(arbiter, "w2", "A", 1.0, logprob=-0.6)
    decisions = answer(arbiter, "w3", "B", 1.0, logprob=-0.3)
    assert decisions == [Commit("w0", "complete")]


def test_a_reply_that_refutes_itself_abstains():
    arbiter = make(names(3))
    answer(arbiter, "w0", "10 + 9 = 10 The answer is 10.", 1.0, logprob=-0.01)
    answer(arbiter, "w1", "10 + 9 = 19", 1.0, logprob=-0.4)
    decisions = answer(arbiter, "w2", "The answer is 10.", 1.0, logprob=-0.3)
    # 19 : 10 is a tie once the false equation abstains; the caller's own did not vote.
    assert arbiter.tally.abstained == ["w0"] and arbiter.tally.votes() == {"19": 1, "10": 1}
    assert decisions == [Commit("w2", "complete")]  # 10's voter is the more confident


def test_all_unextractable_the_most_confident_complete_text_wins():
    arbiter = make(names(3))
    story = "Once upon a time a fox and a crow met by the river and talked for a very long while"
    answer(arbiter, "w0", story, 1.0, logprob=-0.9)
    answer(arbiter, "w1", story + " again", 1.0, logprob=-0.4)
    decisions = answer(arbiter, "w2", story + " more", 1.0, logprob=-0.7)
    assert decisions == [Commit("w1", "no-votes")]
    assert arbiter.tally.votes() == {} and len(arbiter.tally.abstained) == 3


def test_truncated_candidates_vote_with_their_answer_so_far_and_lose_ties_to_complete_ones():
    arbiter = make(names(3))
    answer(arbiter, "w0", "The sum is 13 and", 1.0, finish="length", logprob=-0.01)
    answer(arbiter, "w1", "12", 1.0)
    decisions = answer(arbiter, "w2", "The answer is 13.", 1.0, logprob=-0.5)
    # 13 wins 2 : 1 with the cut-off vote; the complete 13 is sent, though less confident.
    assert decisions == [Commit("w2", "complete")]
    assert arbiter.tally.votes() == {"13": 2, "12": 1} and arbiter.tally.abstained == []


def test_a_candidate_failing_mid_stream_withdraws_and_the_vote_goes_on():
    arbiter = make(names(4), vote_confidence=1.0)
    assert answer(arbiter, "w0", "9", 1.0) == []  # 1 vs 0 with 3 left
    arbiter.handle(TokenArrived("w1", "The answer", logprob=-0.1), 1.0)
    assert arbiter.handle(WorkerFailed("w1", "connection reset"), 1.1) == []  # 2 left
    decisions = answer(arbiter, "w2", "9", 1.2, logprob=-0.05)
    assert decisions == [Commit("w2", "safe"), Cancel("w3")]  # 2 vs 0 with 1 left
    assert arbiter.tally.withdrawn == ["w1"] and arbiter.stopped_early == 1


def test_when_all_but_one_fail_the_survivor_is_committed_live():
    arbiter = make(names(3))
    arbiter.handle(WorkerFailed("w0", "boom"), 1.0)
    assert arbiter.handle(WorkerFailed("w1", "boom"), 1.0) == []  # w2 is still silent
    assert arbiter.handle(TokenArrived("w2", "4"), 1.1) == [Commit("w2", "survivor")]


def test_one_sample_is_committed_at_once_and_streams_live():
    arbiter = Arbiter(["w0"], CONFIG, now=0.0, policy="vote")
    assert arbiter.handle(WorkerStarted("w0"), 0.0) == [Commit("w0", "single")]


def test_read_ballots_counts_each_candidate_once_and_refuted_ones_abstain():
    def view(name: str, text: str, status: WorkerStatus, finish: str = "stop") -> WorkerView:
        v = WorkerView(name, started_at=0.0)
        v.text, v.status, v.finish_reason = text, status, finish
        return v

    views = [
        view("a", "The answer is 12.", WorkerStatus.FINISHED),
        view("b", "3 + 4 = 8, so 8.", WorkerStatus.FINISHED),  # a false equation
        view("c", "It is 12 and", WorkerStatus.FINISHED, finish="length"),
        view("d", "", WorkerStatus.FAILED),
        view("e", "12", WorkerStatus.RUNNING),
    ]
    tally = Tally([v.name for v in views])
    read_ballots(tally, views)
    read_ballots(tally, views)  # already counted: nothing is cast twice
    assert [(b.candidate, b.answer, b.complete) for b in tally.ballots] == [
        ("a", "12", True),
        ("c", "12", False),
    ]
    assert tally.abstained == ["b"] and tally.withdrawn == ["d"] and tally.pending == {"e"}


# Eight samples of one batch, their deltas split at "|": two answers tie for long, so which
# ballots arrive first would decide the vote if arrival order counted.
BATCH = ["7|.", "The answer|is 8", "8", "7", "answer:|8|!", "9|.", "7|!", "8|."]


def interleaved(rng: random.Random) -> Arbiter:
    """The vote over :data:`BATCH` as one batch decodes it: every sample's first delta (in a
    random order), then the rest of the deltas and ends in a random interleaving, each stream's
    own order kept."""
    arbiter = make(names(len(BATCH)), vote_confidence=0.85, vote_scatter=1 / 3)
    streams = []
    for worker, text in zip(names(len(BATCH)), BATCH, strict=True):
        events: list = [TokenArrived(worker, p, logprob=-0.1) for p in text.split("|")]
        streams.append([*events, WorkerFinished(worker, "stop")])
    rng.shuffle(streams)
    for stream in streams:
        arbiter.handle(stream.pop(0), 1.0)
    while arbiter.state is ArbiterState.WATCHING:
        stream = rng.choice([s for s in streams if s])
        arbiter.handle(stream.pop(0), 2.0)
    return arbiter


def test_the_same_samples_give_the_same_winner_however_their_streams_interleave():
    """Ballots count in lockstep order (fewest tokens, then candidate order), not arrival order:
    a seeded request, whose samples are the same texts each time, gets the same answer."""
    outcomes = set()
    for seed in range(60):
        arbiter = interleaved(random.Random(seed))
        outcomes.add((arbiter.winner, arbiter.reason, tuple(arbiter.tally.votes().items())))
    assert len(outcomes) == 1, outcomes


def test_a_finished_sample_waits_only_for_streaming_ones_that_could_finish_before_it():
    arbiter = make(names(3), vote_confidence=1.0)
    arbiter.handle(TokenArrived("w2", "The", logprob=-0.1), 1.0)  # streaming: 1 token so far
    assert answer(arbiter, "w0", "4", 1.1) == []  # 1 token: w2 cannot finish before it
    decisions = answer(arbiter, "w1", "The answer is 4", 1.2)  # 4 tokens: w2 (1) may come first
    assert decisions == [] and [b.candidate for b in arbiter.tally.ballots] == ["w0"]
    # w2 streams on past w1's length: w1's ballot counts, and 2 : 0 with one left is safe.
    for piece in ("answer", "might", "be"):
        decisions = arbiter.handle(TokenArrived("w2", piece, logprob=-0.1), 1.3)
    assert decisions[0] == Commit("w0", "safe")


def test_true_and_its_quoted_form_vote_together_and_e_notation_with_its_decimal():
    views = []
    for i, text in enumerate(['The answer is "True".', "True", "4.37271e+02", "437.271"]):
        view = WorkerView(f"w{i}", started_at=0.0, tokens=3)
        view.text, view.status, view.finish_reason = text, WorkerStatus.FINISHED, "stop"
        views.append(view)
    tally = Tally([v.name for v in views], confidence=1.0)
    read_ballots(tally, views)
    assert tally.votes() == {"true": 2, "437.271": 2}


QUESTION = (
    "Your task is to pick the largest/smallest number out of several options.\n\n"
    "Now, pick the smallest number of the following candidates: 580.505000 587.813000\n"
    "Answer with the number only."
)


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("pick the smallest number of the following candidates: 580.505000 587.813000", None),
        ("Now, pick the smallest number of the following candidates: 580.505000 587.813000", None),
        ("580.505000", "580.505"),
        ("The smallest number is 580.505.", "580.505"),
        ("The following candidates: 580.505000 587.813000. The smallest is 580.505", "580.505"),
    ],
)
def test_a_reply_that_parrots_the_question_does_not_vote_with_its_numbers(text, answer):
    assert extract_answer(text) is not None  # without the question, it would have voted
    assert extract_answer(text, QUESTION) == answer


def test_the_arbiter_reads_ballots_against_the_question():
    arbiter = Arbiter(names(3), CONFIG, now=0.0, policy="vote", question=QUESTION)
    for w in names(3):
        arbiter.handle(WorkerStarted(w), 0.0)
    parrot = "pick the smallest number of the following candidates: 580.505000 587.813000"
    answer(arbiter, "w0", parrot, 1.0)
    answer(arbiter, "w1", parrot, 1.1)
    answer(arbiter, "w2", "580.505", 1.2)
    assert arbiter.winner == "w2" and arbiter.tally.abstained == ["w0", "w1"]


def test_confidence_weighted_ballots_let_a_confident_answer_outvote_a_count():
    """CISC: with a temperature, ballots weigh their softmax share of confidence, and the vote
    waits for every sample (a confident late ballot can outweigh any count)."""
    tally = Tally(["a", "b", "c"], weighted=0.2)
    tally.cast("a", "4", -1.5)
    tally.cast("b", "4", -1.4)
    assert tally.decision() is None and tally.needed() == 1  # 2 : 0 settles a counted vote
    tally.cast("c", "5", -0.1)
    assert tally.decision() == "complete"
    winner = tally.winner()
    assert winner is not None and winner.answer == "5"
    counted = Tally(["a", "b", "c"])
    for name, answer, logprob in (("a", "4", -1.5), ("b", "4", -1.4), ("c", "5", -0.1)):
        counted.cast(name, answer, logprob)
    winner = counted.winner()
    assert winner is not None and winner.answer == "4"
