"""The pure speculation policy: prompt-lookup drafts, the lookup ceiling, a row's rests and
free guesses, how wide a verify pass is worth it, and what steps cost (worker/speculative/policy.py)."""

from __future__ import annotations

import pytest

from worker.speculative.policy import (
    NgramIndex,
    RowPolicy,
    StepCosts,
    best_width,
    expected_tokens,
    lookup_ceiling,
)


def test_prompt_lookup_drafts_what_followed_the_suffix_last_time() -> None:
    index = NgramIndex()
    index.extend([9, 1, 2, 5, 6, 7, 3, 1, 2])
    assert index.draft(3) == [5, 6, 7]
    index.extend([4])  # "2 4" never occurred before
    assert index.draft(3) == []


def test_a_draft_that_reaches_the_present_repeats_itself() -> None:
    index = NgramIndex()
    index.extend([1, 2, 3, 1, 2, 3, 1, 2])
    assert index.draft(7) == [3, 1, 2, 3, 1, 2, 3]


def test_the_longest_match_wins() -> None:
    index = NgramIndex()
    index.extend([7, 8, 1, 2, 7, 5, 8, 9, 1, 2, 7, 8, 1, 2])
    # "1 2" was last followed by 7, but "8 1 2" by 7 too; "7 8 1 2" only at the start: 7 5
    assert index.draft(2) == [7, 5]


def test_the_lookup_ceiling_counts_the_passes_an_answer_allows() -> None:
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]
    # A copy of the prompt's tail: "1 2" drafts 3..10 (all kept) and 11 comes with that pass.
    assert lookup_ceiling(prompt, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], width=8) == (11, 3)
    # Nothing of the prompt: a token a pass.
    assert lookup_ceiling(prompt, [20, 21, 22, 23], width=8) == (4, 4)
    # A draft is cut at the answer's first departure; the departing token comes with the pass.
    assert lookup_ceiling(prompt, [1, 2, 3, 4, 30], width=8) == (5, 3)
    assert lookup_ceiling(prompt, [], width=8) == (0, 0)


def test_a_row_whose_drafts_fail_rests_then_tries_again() -> None:
    policy = RowPolicy(window=10, min_rate=0.5, rest_steps=3)
    policy.record(10, 2)
    assert [policy.may_draft() for _ in range(4)] == [False, False, False, True]
    policy.record(10, 9)
    assert policy.may_draft()


def test_a_row_rests_longer_after_each_failing_window_and_short_again_after_one_that_passes() -> (
    None
):
    policy = RowPolicy(window=10, min_rate=0.5, rest_steps=3, max_rest_steps=8)
    rests = []
    for accepted in (2, 2, 2, 2, 9, 2):
        policy.record(10, accepted)
        rests.append(policy.resting)
        while not policy.may_draft():
            pass
    assert rests == [3, 6, 8, 8, 0, 3]


def test_a_resting_row_wakes_after_its_free_guesses_stand_twice() -> None:
    policy = RowPolicy(window=10, min_rate=0.5, rest_steps=16)
    policy.record(10, 1)
    assert policy.resting == 16
    low = policy.rate
    policy.observe(True)
    policy.observe(False)  # a guess that fell: the count starts again
    policy.observe(True)
    assert policy.resting == 16 and not policy.may_draft()
    policy.observe(True)
    assert policy.resting == 0 and policy.may_draft()
    assert policy.rate > low  # three of four guesses stood: the rate rises with them


def test_expected_tokens_count_the_sampled_one_and_each_draft_while_all_before_stood() -> None:
    assert expected_tokens(0.5, 0) == 1
    assert expected_tokens(0.5, 2) == 1 + 0.5 + 0.25
    assert expected_tokens(1.0, 8) == 9


def test_the_width_follows_acceptance_and_what_a_drafted_position_costs() -> None:
    assert best_width([8], [0.99], slope=0.1) == 9  # copying: draft all it has
    assert best_width([8], [0.05], slope=0.1) == 1  # guesses that fail: a plain step
    assert 1 < best_width([8], [0.6], slope=0.1) < 9  # in between: a few tokens
    assert best_width([8], [0.6], slope=2.0) == 1  # drafted positions dear: never
    # A batch: rows that drafted nothing give their token either way, so they dilute the gain.
    assert best_width([4, 0, 0, 0], [0.7] * 4, slope=0.2) < best_width([4], [0.7], slope=0.2)
    assert best_width([], [], slope=0.1) == 1


def test_a_rows_rate_rises_with_accepted_drafts_and_drifts_back_when_it_rests() -> None:
    policy = RowPolicy()
    assert policy.rate == pytest.approx(policy.prior)  # before any draft
    for _ in range(10):
        policy.record(1, 1)  # short drafts that stand raise it too (not capped by length)
    assert policy.rate > 0.85
    for _ in range(5):
        policy.record(8, 8)
    assert policy.rate > 0.9
    for _ in range(12):
        policy.record(8, 0)
    low = policy.rate
    assert low < 0.4
    policy.skip()
    assert policy.resting >= 8 and not policy.may_draft()
    for _ in range(40):
        policy.skip()
    assert low < policy.rate < 0.5  # forgets toward 0.5: it will try again


def test_step_costs_measure_a_drafted_positions_share_of_a_plain_step() -> None:
    costs = StepCosts(prior_slope=0.15)
    assert costs.model(4) == (0.0, 0.15)  # nothing measured yet
    assert costs.needs_plain(4)
    costs.verify(4, 9, 0.3)  # no plain step at 4 rows to compare with: not a sample
    assert costs.model(4) == (0.0, 0.15)
    for seconds in (0.1, 0.1, 5.0):  # one step shared its time with a prefill chunk
        costs.plain(4, seconds)
    assert not costs.needs_plain(4) and costs.needs_plain(1)
    assert not StepCosts(fixed=0.1).needs_plain(4)
    assert StepCosts(fixed=0.1).model(4) == (0.0, 0.1)
    costs.verify(4, 9, 0.26)
    assert costs.model(4) == (0.0, 0.15)  # one pass is not enough to go on
    costs.verify(4, 9, 0.26)
    costs.verify(4, 9, 0.9)  # it ran beside something else
    # One width cannot tell overhead from slope: the prior slope, the rest overhead.
    overhead, slope = costs.model(4)
    assert slope == 0.15 and overhead == pytest.approx(0.26 / 0.1 - 1 - 8 * 0.15)
    assert costs.model(1) == (0.0, 0.15)  # by rows
    for _ in range(20):
        costs.plain(4, 0.2)
    assert len(costs.plain_s[4]) == costs.samples  # bounded


def test_step_costs_tell_a_passs_overhead_from_what_each_drafted_position_adds() -> None:
    """Narrow passes no longer charge the pass's own overhead to their one drafted position
    (which kept every pass narrow): passes of several widths fit both, robust to an outlier."""
    costs = StepCosts(prior_slope=0.15)
    for _ in range(3):
        costs.plain(1, 0.1)
    for width in (2, 5, 9, 2, 5, 3):
        costs.verify(1, width, 0.1 * (1 + 0.3 + 0.05 * (width - 1)))
    costs.verify(1, 2, 0.1 * 3.5)  # beside a prefill chunk
    overhead, slope = costs.model(1)
    assert overhead == pytest.approx(0.3) and slope == pytest.approx(0.05)
    # What the old single slope made of the 2-token passes: 0.35 a position.
    assert best_width([8], [0.8], slope, overhead) == 9
    assert best_width([8], [0.8], slope=0.35) < 5
    # A lone pass of another width is in every pair: it does not get to set the slope alone.
    lone = StepCosts(prior_slope=0.15)
    for _ in range(3):
        lone.plain(1, 0.1)
    for _ in range(6):
        lone.verify(1, 9, 0.1 * 2.0)
    alone = lone.model(1)  # one width: 1.0 over 8 positions, 0.125 each (under the prior)
    lone.verify(1, 3, 0.1 * 3.0)
    assert alone == (pytest.approx(0.0), pytest.approx(0.125))
    assert lone.model(1)[1] == pytest.approx(0.125)  # the pair slope would have been -0.17
