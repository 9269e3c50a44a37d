"""The MoA arbiter: a pure policy object that watches worker streams and decides whom to splice.

Fed :mod:`gateway.moa.events` worker events with a clock reading (``handle(event, now)``) and
woken at ``next_deadline()`` (``tick(now)``), it returns decisions: ``Commit``, ``Cancel``,
``StartReducer``, ``Fail``. No I/O, no sleeping: tests drive it with made-up times.

Policies:
- ``race``: commit to the first worker whose first N deltas pass the gates (lowest TTFT); with a
  ``preferred`` worker (self-mixture: the caller's own sample), a passer that is not it waits
  for the preferred one's first token (``race_prefer_window_s``, or ``race_prefer_fraction`` of
  the passer's time to first token if longer), and once that streams, for its verdict: another
  sample wins only when the caller's own one is silent, slow or fails.
- ``consensus``: commit when workers agree (equal finished answers or a shared prefix), else at
  the grace deadline to the best-scored stream.
- ``reduce``: once k of n answers are complete (or at the grace deadline) run an aggregator over
  them on the strongest model and splice *its* stream.
- ``vote``: each finished worker votes with its extracted final answer; as soon as the
  :class:`~gateway.moa.vote.Tally` says the vote is decided, commit the leading answer's most
  confident worker (finished, so its whole text goes out at once) and stop the rest. A worker cut
  off by ``max_tokens`` abstains; when nobody votes, the most confident finished text wins.
  Samples start in waves (``wave``): the next is launched only when a whole wave is in and
  the vote is still open, so an early decision saves the samples never started.
- ``single``: one worker (the best model's greedy answer), committed as it starts.
- ``judge``: every candidate runs to its end (once most have finished, the rest get
  ``grace_s``); the complete ones are ranked by confidence and, when they differ, the strongest
  model picks one (:mod:`gateway.moa.judge`); a judge that names none leaves the most confident.

Common rules: a worker without a first delta by ``first_token_timeout_s``, or still running at
``total_timeout_s``, is failed and cancelled; the last survivor is committed as is once it has
streamed anything; when all fail the request fails.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Mapping, Sequence

from gateway.events import ErrorKind
from gateway.moa import central, gates, judge, scoring
from gateway.moa.config import MoaConfig, Policy
from gateway.moa.events import (
    Cancel,
    Commit,
    Decision,
    Fail,
    Launch,
    StartJudge,
    StartReducer,
    TokenArrived,
    WorkerEvent,
    WorkerFailed,
    WorkerFinished,
    WorkerStarted,
)
from gateway.moa.views import WorkerStatus, WorkerView
from gateway.moa.vote import Tally, read_ballots

log = logging.getLogger(__name__)

REDUCER = "reducer"


class ArbiterState(enum.Enum):
    WATCHING = "watching"
    REDUCING = "reducing"
    JUDGING = "judging"
    COMMITTED = "committed"
    FAILED = "failed"


class Arbiter:
    """Decides, for one ``mesh`` request, which worker's stream the client gets."""

    def __init__(
        self,
        workers: Sequence[str],
        config: MoaConfig,
        *,
        now: float,
        policy: Policy | None = None,
        win_rates: Mapping[str, float] | None = None,
        preferred: str | None = None,
        wave: int | None = None,
        question: str | None = None,
    ) -> None:
        if not workers:
            raise ValueError("an arbiter needs at least one worker")
        self.config = config
        # "auto" is resolved per request before an arbiter exists (gateway/moa/auto.py).
        self.policy: Policy = policy or (config.policy if config.policy != "auto" else "race")
        self.workers: dict[str, WorkerView] = {w: WorkerView(w, started_at=now) for w in workers}
        self.win_rates = dict(win_rates or {})
        self.preferred = preferred if preferred in self.workers else None
        self.question = question  # vote: a sample's echoes of it do not vote
        # race: when another worker first passed the gates while the preferred one had not.
        self.prefer_deadline: float | None = None
        self.state = ArbiterState.WATCHING
        self.started_at = now
        self.first_content_at: float | None = None
        self.winner: str | None = None
        self.reason: str | None = None
        self.decided_at: float | None = None
        self.reducer_fallback: str | None = None
        # judge: when most candidates had finished; the options the judge was shown.
        self.majority_at: float | None = None
        self.judge_options: list[str] = []
        # Workers still running when the decision stopped them (the cost the decision saved),
        # and vote samples of later waves that never had to start.
        self.stopped_early = self.never_started = 0
        # vote: the first ``wave`` workers start now, the others wait for an undecided vote.
        self.wave = max(1, wave) if wave and self.policy == "vote" else len(workers)
        for view in list(self.workers.values())[self.wave :]:
            view.status = WorkerStatus.WAITING
        self.launched = list(workers)[: self.wave]
        # Ties go to the first candidate's answer: the caller's own request (plan_candidates).
        self.tally = Tally(
            workers,
            confidence=config.vote_confidence,
            preferred=next(iter(workers)),
            scatter=config.vote_scatter,
            weighted=config.vote_confidence_tau,
        )
        self._grace_passed = False
        self._handlers: dict[type, Callable[[WorkerView, WorkerEvent, float], None]] = {
            WorkerStarted: self._on_started,
            TokenArrived: self._on_token,
            WorkerFinished: self._on_finished,
            WorkerFailed: self._on_failed,
        }
        self._policies: dict[str, Callable[[float], list[Decision]]] = {
            "race": self._decide_race,
            "consensus": self._decide_consensus,
            "reduce": self._decide_reduce,
            "vote": self._decide_vote,
            "judge": self._decide_judge,
            "single": self._decide_race,  # one worker: committed when it starts (_decide)
        }

    # -- inputs ---------------------------------------------------------------------------

    def handle(self, event: WorkerEvent, now: float) -> list[Decision]:
        view = self.workers.get(event.worker)
        if view is None or self.state in (ArbiterState.COMMITTED, ArbiterState.FAILED):
            return []
        self._handlers[type(event)](view, event, now)
        return self._decide(now)

    def tick(self, now: float) -> list[Decision]:
        """Apply deadlines that have passed by ``now``."""
        if self.state in (ArbiterState.COMMITTED, ArbiterState.FAILED):
            return []
        decisions: list[Decision] = []
        grace = self.grace_deadline()
        if grace is not None and now >= grace:
            # From now on the grace period is over; it is no longer a deadline to wake up for
            # (the decision then happens on the next event that makes one possible).
            self._grace_passed = True
        for view in self.workers.values():
            if not view.running:
                continue
            if view.first_token_at is None and now >= self._first_token_deadline(view):
                reason = f"no first token within {self.config.first_token_timeout_s:g}s"
            elif now >= view.started_at + self.config.total_timeout_s:
                reason = f"not finished within {self.config.total_timeout_s:g}s"
            else:
                continue
            self._mark_failed(view, reason, timeout=True)
            decisions.append(Cancel(view.name))
        return decisions + self._decide(now)

    def next_deadline(self) -> float | None:
        """When ``tick`` must be called next (None: only events can change anything)."""
        if self.state in (ArbiterState.COMMITTED, ArbiterState.FAILED):
            return None
        times = []
        for view in self.workers.values():
            if view.running:
                times.append(view.started_at + self.config.total_timeout_s)
                if view.first_token_at is None:
                    times.append(self._first_token_deadline(view))
        if self.prefer_deadline is not None and self.policy == "race":
            times.append(self.prefer_deadline)
        grace = self.grace_deadline()
        if grace is not None and not self._grace_passed and self.policy not in ("race", "judge"):
            if self.state is ArbiterState.WATCHING:
                times.append(grace)
        if self.majority_at is not None and self.state is ArbiterState.WATCHING:
            times.append(self.majority_at + self.config.grace_s)
        return min(times) if times else None

    def started(self) -> list[str]:
        """The workers started (or to start now): every one but the vote's later waves, until
        they are launched."""
        return list(self.launched)

    def grace_deadline(self) -> float | None:
        if self.first_content_at is None:
            return None
        return self.first_content_at + self.config.grace_s

    # -- event handlers -------------------------------------------------------------------

    def _on_started(self, view: WorkerView, event: WorkerEvent, now: float) -> None:
        view.started_at = now

    def _on_token(self, view: WorkerView, event: WorkerEvent, now: float) -> None:
        assert isinstance(event, TokenArrived)
        if not view.running:
            return
        if view.first_token_at is None:
            view.first_token_at = now
        if self.first_content_at is None and view.name != REDUCER:
            self.first_content_at = now
        view.tokens += 1
        if event.channel == "text":
            view.text += event.text
        elif event.channel == "reasoning":
            view.reasoning += event.text
        else:
            view.tool_calls += 1
        if event.logprob is not None:
            view.logprob_sum += event.logprob
            view.logprob_count += 1

    def _on_finished(self, view: WorkerView, event: WorkerEvent, now: float) -> None:
        assert isinstance(event, WorkerFinished)
        if view.running:
            view.status = WorkerStatus.FINISHED
            view.finish_reason = event.finish_reason

    def _on_failed(self, view: WorkerView, event: WorkerEvent, now: float) -> None:
        assert isinstance(event, WorkerFailed)
        if view.running:
            self._mark_failed(view, event.reason, timeout=event.timeout)

    def _mark_failed(self, view: WorkerView, reason: str, *, timeout: bool) -> None:
        log.info("moa worker %s failed: %s", view.name, reason)
        view.status = WorkerStatus.FAILED
        view.failure = reason
        view.timed_out = timeout

    def _first_token_deadline(self, view: WorkerView) -> float:
        return view.started_at + self.config.first_token_timeout_s

    # -- decisions ------------------------------------------------------------------------

    def _set_state(self, state: ArbiterState) -> None:
        log.debug("moa arbiter %s -> %s", self.state.value, state.value)
        self.state = state

    def _decide(self, now: float) -> list[Decision]:
        if self.state is ArbiterState.REDUCING:
            return self._decide_reducing(now)
        if self.state is ArbiterState.JUDGING:
            return self._decide_judging(now)
        candidates = [v for v in self.workers.values() if v.alive]
        if not candidates:
            return self._fail_all()
        if len(candidates) == 1 and not candidates[0].waiting:
            last = candidates[0]
            if len(self.workers) == 1:
                return self._commit(last.name, "single", now)
            # The last one left is committed once it streams: while silent it may still miss
            # its first-token deadline, and then the request fails with a real status.
            if last.first_token_at is None and not last.finished:
                return []
            return self._commit(last.name, "survivor", now)
        return self._policies[self.policy](now)

    def _commit(self, worker: str, reason: str, now: float) -> list[Decision]:
        self.winner, self.reason, self.decided_at = worker, reason, now
        self._set_state(ArbiterState.COMMITTED)
        decisions: list[Decision] = [Commit(worker, reason)]
        for view in self.workers.values():
            if view.name != worker and view.running:
                view.status = WorkerStatus.CANCELLED
                decisions.append(Cancel(view.name))
                self.stopped_early += 1
            elif view.waiting:  # never started: nothing to stop
                view.status = WorkerStatus.CANCELLED
                self.never_started += 1
        return decisions

    def _fail_all(self) -> list[Decision]:
        self._set_state(ArbiterState.FAILED)
        failures = [v for v in self.workers.values() if v.name not in (REDUCER, judge.JUDGE)]
        reasons = "; ".join(f"{v.name}: {v.failure}" for v in failures)
        kind: ErrorKind = (
            "timeout" if failures and all(v.timed_out for v in failures) else "upstream"
        )
        return [Fail(kind, f"all {len(failures)} MoA workers failed ({reasons})")]

    def score(self, view: WorkerView) -> float:
        verdict = view.verdict()
        return scoring.stream_score(
            logprob=scoring.mean_logprob(view.logprob_sum, view.logprob_count),
            passes_gates=verdict in (gates.Verdict.PASS, gates.Verdict.REFUSAL),
            refusal=verdict is gates.Verdict.REFUSAL,
            win_rate=self.win_rates.get(view.name, 0.5),
            support=self._support(view),
            finished=view.finished,
        )

    def _support(self, view: WorkerView) -> float:
        """Share of the other live workers whose text agrees with this one so far."""
        others = [
            (v.text, v.finished)
            for v in self.workers.values()
            if v.alive and v is not view and v.name != REDUCER
        ]
        return scoring.agreement_share(
            view.text, view.finished, others, self.config.agree_prefix_chars
        )

    def _best(self, views: Sequence[WorkerView]) -> WorkerView:
        # Highest score; ties go to the worker with more output, then the earliest.
        return max(views, key=lambda v: (self.score(v), v.tokens, -(v.first_token_at or 0.0)))

    def _fallback_if_settled(self, candidates: list[WorkerView], now: float) -> list[Decision]:
        """Nobody passes and nobody still can: commit the least bad stream."""

        def settled(view: WorkerView) -> bool:
            if view.finished:
                return True
            sticky = (gates.Verdict.MARKUP, gates.Verdict.REPETITION, gates.Verdict.REFUSAL)
            return view.tokens >= self.config.race_min_tokens and view.verdict() in sticky

        if all(settled(v) for v in candidates):
            return self._commit(self._best(candidates).name, "fallback", now)
        return []

    def _race_ready(self, view: WorkerView) -> bool:
        """Has this worker shown enough for the gates to judge it?"""
        if view.finished or view.tokens >= self.config.race_min_tokens:
            return True
        if not (self.config.race_early_commit and view.tokens):
            return False
        return bool(view.tool_calls) or gates.is_conclusive(
            view.text if view.text.strip() else view.reasoning
        )

    def _decide_race(self, now: float) -> list[Decision]:
        candidates = [v for v in self.workers.values() if v.alive]
        ready = [v for v in candidates if self._race_ready(v)]
        passers = [v for v in ready if v.verdict() is gates.Verdict.PASS]
        if not passers:
            return self._fallback_if_settled(candidates, now)
        first = min(passers, key=lambda v: v.first_token_at or now)
        prefer = self.preferred is not None and self.config.race_prefer_window_s > 0
        preferred = self.workers[self.preferred] if prefer else None  # type: ignore[index]
        if preferred is None or first is preferred or preferred in passers:
            return self._commit((preferred if preferred in passers else first).name, "race", now)
        if not preferred.running or self._race_ready(preferred):
            # Failed, finished or judged without passing: it never will.
            return self._commit(first.name, "race", now)
        if preferred.first_token_at is not None:
            # Streaming: its opening is judged within race_min_tokens tokens. Samples of one
            # model share a batch and keep pace, so another sample's quicker *verdict* (a
            # conclusive first word) must not replace the caller's own temperature and seed.
            return []
        if self.prefer_deadline is None:
            ttft = (first.first_token_at or now) - first.started_at
            wait = max(self.config.race_prefer_window_s, self.config.race_prefer_fraction * ttft)
            self.prefer_deadline = now + wait
        if now >= self.prefer_deadline:
            return self._commit(first.name, "race", now)
        return []  # give the preferred worker its window

    def _decide_consensus(self, now: float) -> list[Decision]:
        candidates = [v for v in self.workers.values() if v.alive]
        passing = [v for v in candidates if v.verdict() is gates.Verdict.PASS]
        finished = [v for v in passing if v.finished]
        groups = scoring.agreeing_groups({v.name: v.text for v in finished})
        if groups and len(groups[0]) >= 2:
            return self._commit(
                self._best([self.workers[w] for w in groups[0]]).name, "agreement", now
            )
        group = scoring.prefix_agreement(
            {v.name: v.text for v in passing}, self.config.agree_prefix_chars
        )
        if group:
            return self._commit(self._best([self.workers[w] for w in group]).name, "agreement", now)
        if not any(v.running for v in candidates):
            return self._commit(self._best(candidates).name, "complete", now)
        grace = self.grace_deadline()
        if grace is not None and now >= grace:
            with_output = [v for v in candidates if v.tokens]
            if with_output:
                return self._commit(self._best(with_output).name, "grace", now)
        return []

    def _decide_reduce(self, now: float) -> list[Decision]:
        candidates = [v for v in self.workers.values() if v.alive]
        answers = [v for v in candidates if v.finished and v.text.strip()]
        k = min(self.config.reduce_k or len(self.workers) // 2 + 1, len(self.workers))
        grace = self.grace_deadline()
        due = (
            len(answers) >= k
            or not any(v.running for v in candidates)
            or (grace is not None and now >= grace and answers)
        )
        if not due:
            return []
        if not answers:  # everyone finished empty-handed
            return self._commit(self._best(candidates).name, "complete", now)
        best = self._best(answers)
        if (
            len(answers) == 1
            or len(scoring.agreeing_groups({v.name: v.text for v in answers})) == 1
        ):
            return self._commit(best.name, "unanimous" if len(answers) > 1 else "grace", now)
        self._set_state(ArbiterState.REDUCING)
        self.reducer_fallback = best.name
        decisions: list[Decision] = []
        for view in candidates:
            if view.running:
                view.status = WorkerStatus.CANCELLED
                decisions.append(Cancel(view.name))
        self.workers[REDUCER] = WorkerView(REDUCER, started_at=now)
        decisions.append(
            StartReducer(REDUCER, tuple((v.name, v.text) for v in answers), fallback=best.name)
        )
        return decisions

    def _decide_vote(self, now: float) -> list[Decision]:
        read_ballots(self.tally, self.workers.values(), self.question)
        reason = self.tally.decision()
        if reason is None:
            if any(v.running for v in self.workers.values()):
                return []
            return self._launch_wave(now)  # a whole wave is in, the vote still open
        ballot = self.tally.winner()
        if ballot is not None:
            return self._commit(ballot.candidate, reason, now)
        # Nobody had an answer to vote with: the most confident complete text stands.
        finished = [v for v in self.workers.values() if v.finished]
        return self._commit(judge.most_confident(finished).name, "no-votes", now)

    def _decide_judge(self, now: float) -> list[Decision]:
        candidates = [v for v in self.workers.values() if v.alive]
        finished = [v for v in candidates if v.finished]
        if self.majority_at is None and 2 * len(finished) > len(self.workers):
            self.majority_at = now
        running = [v for v in candidates if v.running]
        due = self.majority_at is not None and now >= self.majority_at + self.config.grace_s
        if running and not due:
            return []
        shown = judge.options(finished, self.config.judge_options)
        if not shown:  # nobody finished with text
            return self._commit(self._best(candidates).name, "complete", now)
        if len(shown) == 1 or not self.config.judge_pick:
            if len(shown) > 1 and self.config.judge_select == "consensus":
                chosen = central.most_central(finished) or shown[0]
                return self._commit(chosen.name, "consensus", now)
            return self._commit(
                shown[0].name, "agreement" if len(shown) == 1 else "confidence", now
            )
        self._set_state(ArbiterState.JUDGING)
        self.judge_options = [v.name for v in shown]
        decisions: list[Decision] = []
        for view in running:
            view.status = WorkerStatus.CANCELLED
            decisions.append(Cancel(view.name))
            self.stopped_early += 1
        self.workers[judge.JUDGE] = WorkerView(judge.JUDGE, started_at=now)
        options = tuple((v.name, v.text) for v in shown)
        return [*decisions, StartJudge(judge.JUDGE, options, fallback=shown[0].name)]

    def _decide_judging(self, now: float) -> list[Decision]:
        view = self.workers[judge.JUDGE]
        if view.running:
            return []
        picked = judge.read_choice(view.text, len(self.judge_options)) if view.finished else None
        if picked is None:  # failed, or named nothing: the most confident option stands
            return self._commit(self.judge_options[0], "judge-failed", now)
        return self._commit(self.judge_options[picked], "judged", now)

    def _launch_wave(self, now: float) -> list[Decision]:
        size = min(self.wave, self.tally.needed())  # 3 : 0 → one more sample, not a wave
        waiting = [v for v in self.workers.values() if v.waiting][:size]
        for view in waiting:
            view.status = WorkerStatus.RUNNING
            view.started_at = now
            self.launched.append(view.name)
        return [Launch(tuple(v.name for v in waiting))] if waiting else []

    def _decide_reducing(self, now: float) -> list[Decision]:
        reducer = self.workers[REDUCER]
        if reducer.tokens and reducer.alive:
            return self._commit(REDUCER, "reduced", now)
        if reducer.alive and not reducer.finished:
            return []
        # The aggregator failed (or said nothing): the best complete answer stands in.
        if self.reducer_fallback is not None:
            return self._commit(self.reducer_fallback, "reducer-failed", now)
        return self._fail_all()
