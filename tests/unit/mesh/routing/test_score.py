"""Ranking nodes for a prompt: cache against load and RTT, stickiness and spread on ties."""

from __future__ import annotations

from mesh.routing.score import Candidate, Policy, affinity, cost, rank

NOW = 100.0


def fresh(node_id: str, cached: int = 0, **load) -> Candidate:
    return Candidate(node_id, cached_tokens=cached, digest_at=NOW - 1, **load)


def test_the_node_holding_the_prefix_wins_and_says_so():
    ranked = rank([fresh("a"), fresh("b", 18432), fresh("c", 1024)], prompt_tokens=20100, now=NOW)
    assert [c.node_id for c in ranked] == ["b", "c", "a"]
    assert ranked[0].reason == "cache 18432/20100 (1.67s <= 19.08s elsewhere)"


def test_load_beats_a_small_cached_prefix():
    busy = fresh("a", 512, queue_depth=3, running=2, ttft_s=2.0)
    ranked = rank([busy, fresh("b")], prompt_tokens=2000, now=NOW)
    assert ranked[0].node_id == "b"
    # The rule's numbers: a's wait and the prefill it lacks, against b's cold prefill.
    assert ranked[0].reason == "load (a holds 512/2000 but 3.69s > 2.00s)"


def test_a_long_prefix_is_worth_waiting_for_one_running_request():
    ranked = rank(
        [fresh("a", 20000, running=1, ttft_s=0.5), fresh("b")], prompt_tokens=20100, now=NOW
    )
    assert ranked[0].node_id == "a"


def test_running_rows_share_the_batch_but_queued_requests_wait_for_a_prefill_batch():
    # Half the prompt cached: 1 s of prefill saved (1,000 tok/s), against idle "b".
    batching = fresh("a", 1000, running=7, ttft_s=0.5)
    assert rank([batching, fresh("b")], prompt_tokens=2000, now=NOW)[0].node_id == "a"
    # Seven queued prefill together: one batch ahead, 0.5 s, and the cache still wins...
    burst = fresh("a", 1000, queue_depth=7, ttft_s=0.5)
    assert rank([burst, fresh("b")], prompt_tokens=2000, now=NOW)[0].node_id == "a"
    # ...but seventeen fill three batches (1.5 s): the idle node wins on load.
    queued = fresh("a", 1000, queue_depth=17, ttft_s=0.5)
    ranked = rank([queued, fresh("b")], prompt_tokens=2000, now=NOW)
    assert ranked[0].node_id == "b" and ranked[0].reason.startswith("load (a holds 1000/2000")
    assert cost(fresh("a", 0, queue_depth=8), 100, NOW, Policy()) == cost(
        fresh("a", 0, queue_depth=1), 100, NOW, Policy()
    )


def test_a_queue_heard_a_while_ago_has_drained_by_its_age():
    # Three batches queued at 0.5 s each outweigh 1 s of prefill when heard now...
    now_heard = fresh("a", 1000, queue_depth=17, ttft_s=0.5, load_at=NOW)
    assert rank([now_heard, fresh("b")], prompt_tokens=2000, now=NOW)[0].node_id == "b"
    # ...but heard 1 s ago two of them have been served: one left, the cache wins.
    heard_before = fresh("a", 1000, queue_depth=17, ttft_s=0.5, load_at=NOW - 1.0)
    assert rank([heard_before, fresh("b")], prompt_tokens=2000, now=NOW)[0].node_id == "a"
    # A queue never drains below empty, and a report from the future counts in full.
    idle = cost(fresh("a", 0, ttft_s=0.5), 2000, NOW, Policy())
    one = cost(fresh("a", 0, queue_depth=1, ttft_s=0.5), 2000, NOW, Policy())
    long_ago = fresh("a", 0, queue_depth=1, ttft_s=0.5, load_at=NOW - 60)
    future = fresh("a", 0, queue_depth=1, ttft_s=0.5, load_at=NOW + 5)
    assert cost(long_ago, 2000, NOW, Policy()) == idle
    assert cost(future, 2000, NOW, Policy()) == one > idle


def test_a_stale_digest_counts_for_nothing():
    stale = Candidate("a", cached_tokens=20000, digest_at=NOW - 31)
    ranked = rank([stale, fresh("b")], prompt_tokens=20100, now=NOW, session_key="s")
    assert ranked[0].cached_tokens == 0
    assert ranked[0].reason == "sticky"


def test_rtt_counts():
    far = fresh("a", rtt_s=0.5)
    ranked = rank([far, fresh("b", rtt_s=0.001)], prompt_tokens=100, now=NOW)
    assert [c.node_id for c in ranked] == ["b", "a"]
    assert ranked[0].reason == "load"


def test_a_session_sticks_to_its_rendezvous_node_when_nothing_else_decides():
    nodes = [fresh(n) for n in "abcd"]
    for session in ("s1", "s2", "s3"):
        expected = max("abcd", key=lambda n: affinity(session, n))
        for turn in range(3):
            ranked = rank(nodes, prompt_tokens=500, now=NOW, session_key=session, turn=turn)
            assert ranked[0].node_id == expected
            assert ranked[0].reason == "sticky"


def test_new_sessions_spread_over_idle_nodes():
    nodes = [fresh(n) for n in "abc"]
    firsts = {rank(nodes, prompt_tokens=500, now=NOW, session_key=f"s{i}")[0].node_id for i in range(30)}  # fmt: skip
    assert firsts == {"a", "b", "c"}
    turns = [rank(nodes, prompt_tokens=500, now=NOW, turn=t)[0] for t in range(3)]
    assert {c.node_id for c in turns} == {"a", "b", "c"}
    assert {c.reason for c in turns} == {"spread"}


def test_a_busy_node_is_left_out_of_the_spread():
    nodes = [fresh("a", running=1), fresh("b"), fresh("c")]
    firsts = {rank(nodes, prompt_tokens=500, now=NOW, turn=t)[0].node_id for t in range(6)}
    assert firsts == {"b", "c"}


def test_one_candidate_and_none():
    assert rank([fresh("a")], prompt_tokens=10, now=NOW)[0].reason == "only"
    assert rank([], prompt_tokens=10, now=NOW) == []


def test_the_whole_prompt_cached_still_leaves_one_token_to_run():
    ranked = rank([fresh("a", 4096)], prompt_tokens=4096, now=NOW, policy=Policy())
    assert ranked[0].cached_tokens == 4095


def test_this_node_wins_a_tie_no_session_decides_and_load_spreads_the_rest():
    idle = [fresh("a"), fresh("b"), fresh("me")]
    assert rank(idle, prompt_tokens=500, now=NOW, prefer="me")[0].reason == "local"
    busy = [fresh("a"), fresh("b"), fresh("me", running=1)]
    assert rank(busy, prompt_tokens=500, now=NOW, prefer="me")[0].node_id in {"a", "b"}
    with_session = rank(idle, prompt_tokens=500, now=NOW, prefer="me", session_key="s1")
    assert with_session[0].reason == "sticky"


def test_a_tie_goes_to_the_node_holding_more_of_the_prompt_before_the_session():
    # 40 tokens cached is within the tie's margin, but it is the conversation's: it wins the
    # tie whatever the session hash says.
    for key in (f"s{i}" for i in range(20)):
        ranked = rank([fresh("a"), fresh("b", 40)], prompt_tokens=400, now=NOW, session_key=key)
        assert ranked[0].node_id == "b"
        assert ranked[0].reason.startswith("cache 40/400 (")


def test_a_measured_prefill_rate_and_backlog_replace_the_guesses():
    # The holder's queue has 1,000 prompt tokens to prefill at 100 tok/s (10 s): a cold prefill
    # of 2,000 tokens at 500 tok/s (4 s) elsewhere wins, and the reason says by how much.
    holder = fresh("a", 1900, prefill_tok_s=100.0, backlog_tokens=1000)
    cold = fresh("b", prefill_tok_s=500.0, backlog_tokens=0)
    ranked = rank([holder, cold], prompt_tokens=2000, now=NOW)
    assert ranked[0].node_id == "b"
    assert ranked[0].reason == "load (a holds 1900/2000 but 11.00s > 4.00s)"
    # With its queue empty the holder wins: 100 tokens at 100 tok/s against 4 s.
    idle = fresh("a", 1900, prefill_tok_s=100.0, backlog_tokens=0)
    ranked = rank([idle, cold], prompt_tokens=2000, now=NOW)
    assert ranked[0].reason == "cache 1900/2000 (1.00s <= 4.00s elsewhere)"


def test_a_prefix_on_disk_costs_its_restore_and_still_beats_a_cold_prefill():
    # 2,000 tokens: 10 s cold at 200 tok/s. On disk at "a": a 1.0 s read of 1,900 tokens, then
    # 0.5 s for the rest; in memory at "b" only the first 1,000 (5 s of prefill left).
    on_disk = fresh("a", 1900, prefill_tok_s=200.0, backlog_tokens=0, restore_tokens=1900, restore_tok_s=1900.0)  # fmt: skip
    in_memory = fresh("b", 1000, prefill_tok_s=200.0, backlog_tokens=0)
    assert cost(on_disk, 2000, NOW, Policy()) == 1.5
    ranked = rank(
        [in_memory, on_disk, fresh("c", prefill_tok_s=200.0)], prompt_tokens=2000, now=NOW
    )
    assert [c.node_id for c in ranked] == ["a", "b", "c"]
    # Unmeasured, a restore counts ten times the prefill rate.
    guessed = fresh("a", 1900, prefill_tok_s=200.0, restore_tokens=1900)
    assert cost(guessed, 2000, NOW, Policy()) == 0.5 + 1900 / 2000
