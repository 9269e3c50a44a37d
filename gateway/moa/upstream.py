"""``model="mesh"``: the asyncio orchestrator that runs the workers, feeds the arbiter and splices
the winner's live stream into the client's.

Each worker call runs as a pump task that puts ``(worker, event)`` pairs on one queue. Until the
arbiter commits, events are only buffered (no text reaches the client); on commit the winner's
buffer is flushed at once and its live events follow as they arrive. Losers are cancelled: their
pump task is cancelled and their stream iterator closed, which closes the worker's HTTP response
or resets the peer's tunnel stream. Closing this stream (client disconnect) cancels every worker.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass

from gateway.events import (
    Done,
    Error,
    Event,
    Meta,
    Progress,
    ReasoningDelta,
    TextDelta,
    ToolCallDelta,
    is_terminal,
)
from gateway.moa.arbiter import Arbiter
from gateway.moa.auto import choose_policy, last_user_text
from gateway.moa.candidates import (
    Candidate,
    mixable_models,
    plan_candidates,
    plan_samples,
    plan_single,
    ranked_routes,
    reducer_request,
    strongest,
)
from gateway.moa.config import JUDGE_SELECTIONS, MAX_SAMPLES, POLICIES, MoaConfig, Policy
from gateway.moa.costs import decision_headers
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
from gateway.moa.gates import Verdict
from gateway.moa.judge import judge_request
from gateway.moa.scoring import WinRecord
from gateway.moa.track_record import Counts, TrackRecord, measured
from gateway.request import ChatRequest
from gateway.router import ROUTE_REASON_HEADER
from gateway.upstream import (
    MESH_MODEL,
    ModelDirectory,
    ModelInfo,
    StartHold,
    Upstream,
    close_stream,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _StreamBroke:
    """A worker stream that raised or ended without its terminal event."""

    reason: str


# What counts as a first token (the arbiter's TokenArrived).
_CONTENT = (TextDelta, ReasoningDelta, ToolCallDelta)


def _worker_event(worker: str, event: Event | _StreamBroke) -> WorkerEvent | None:
    """What the arbiter learns from one upstream event (None: nothing it judges)."""
    match event:
        case TextDelta():
            return TokenArrived(worker, event.text, "text", event.logprob)
        case ReasoningDelta():
            return TokenArrived(worker, event.text, "reasoning")
        case ToolCallDelta():
            return TokenArrived(worker, event.arguments or event.name or "", "tool")
        case Done():
            return WorkerFinished(worker, event.finish_reason)
        case Error():
            return WorkerFailed(worker, f"{event.kind}: {event.message}", event.kind == "timeout")
        case _StreamBroke():
            return WorkerFailed(worker, event.reason)
    return None


async def _pump(
    worker: str,
    upstream: Upstream,
    request: ChatRequest,
    queue: asyncio.Queue[tuple[str, Event | _StreamBroke]],
) -> None:
    """Copy one worker stream onto the shared queue; closing the iterator on the way out."""
    iterator: AsyncIterator[Event] | None = None
    try:
        iterator = upstream.stream(request)
        ended = False
        async for event in iterator:
            # Read on past the terminal event so the stream finishes on its own (a winner's
            # stream is complete, not cancelled); anything after it is not part of the answer.
            if not ended:
                queue.put_nowait((worker, event))
                ended = is_terminal(event)
        if not ended:
            queue.put_nowait((worker, _StreamBroke("stream ended without a terminal event")))
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # any upstream bug or broken connection is this worker's failure
        log.warning("moa worker %s raised %r", worker, exc)
        queue.put_nowait((worker, _StreamBroke(f"worker raised {exc!r}")))
    finally:
        try:
            if iterator is not None:  # None: ``upstream.stream`` itself raised
                await close_stream(iterator)
        except RuntimeError as exc:  # e.g. closing a generator that is still running
            log.warning("moa worker %s did not close cleanly: %r", worker, exc)


def _self_mixture(candidates: list[Candidate]) -> bool:
    """Several samples of one model: the first is the caller's own temperature."""
    return len(candidates) > 1 and len({c.model.id for c in candidates}) == 1


class MixtureOfAgents(Upstream):
    """The ``mesh`` model: an :class:`~gateway.upstream.Upstream` over the directory's models.

    Its stream opens with a ``Meta`` of the policy and worker count and sends a second one with
    the winner at the decision; ``start_hold`` tells the gateway to hold the response start for
    that second one (see gateway/exchange.py). It is never retried: its arbiter already outlives
    failing workers, and a second fan-out would only double the load on a failing mesh.
    """

    name = MESH_MODEL
    retryable = False
    decision_header = "x-moa-winner"

    def __init__(
        self,
        directory: ModelDirectory,
        config: MoaConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        record: TrackRecord | None = None,
    ) -> None:
        self.directory = directory
        self.config = config or MoaConfig()
        self.clock = clock
        self.wins = WinRecord()
        # Each model's agreement with decided votes and race openings passing the gates, this
        # node's (gossiped by the mesh) summed with the peers' (``directory.track_records``).
        self.record = record or TrackRecord()

    def standing(self, model: str, record: Mapping[str, Counts]) -> float:
        """What a model's stream brings to the race's score: its measured quality once there is
        enough of it (gateway/moa/track_record.py), else how often its stream won here."""
        quality = measured(model, record)
        return quality if quality is not None else self.wins.rate(model)

    def track_record(self) -> dict[str, Counts]:
        """This node's and its peers' counts per model (gateway/moa/track_record.py)."""
        peers = getattr(self.directory, "track_records", None)
        return self.record.merged(peers() if peers is not None else ())

    @property
    def start_hold(self) -> StartHold:
        """Until the winner header, at most as long as the decision normally takes: every
        worker's first-token deadline, then the consensus/reduce grace period (a reduce
        aggregator may take longer still)."""
        wait_s = self.config.first_token_timeout_s + self.config.grace_s
        return StartHold(self.decision_header, wait_s)

    def stream(self, request: ChatRequest) -> AsyncIterator[Event]:
        return self._stream(request)

    def _resolve(self, request: ChatRequest) -> tuple[Policy | None, str | None]:
        """The policy and, when ``auto`` chose it, the rule that did."""
        asked = request.metadata.get("moa_policy", self.config.policy)
        if asked not in POLICIES:
            return None, None
        if asked == "auto":
            return choose_policy(request, vote=self.config.auto_vote)
        return asked, None

    def samples_for(self, request: ChatRequest) -> int | None:
        """The vote's sample count (``metadata["moa_samples"]``, 1..32), None when invalid."""
        asked = request.metadata.get("moa_samples", self.config.vote_samples)
        try:
            n = int(asked)
        except (TypeError, ValueError):
            return None
        return n if 1 <= n <= MAX_SAMPLES and str(asked).strip() == str(n) else None

    async def _stream(self, request: ChatRequest) -> AsyncIterator[Event]:
        policy, auto = self._resolve(request)
        if policy is None:
            yield Error(
                "invalid_request",
                f"unknown moa_policy {request.metadata.get('moa_policy')!r}; "
                f"expected one of {', '.join(POLICIES)}",
            )
            return
        n = 1 if policy == "single" else self.config.max_workers  # one per model, or samples
        if policy in ("vote", "judge"):
            samples = self.samples_for(request)
            if samples is None:
                yield Error(
                    "invalid_request",
                    f"moa_samples must be an integer from 1 to {MAX_SAMPLES}, "
                    f"not {request.metadata.get('moa_samples')!r}",
                )
                return
            n = samples
        select = request.metadata.get("moa_select", self.config.judge_select)
        if select not in JUDGE_SELECTIONS:
            yield Error(
                "invalid_request",
                f"unknown moa_select {select!r}; expected one of {', '.join(JUDGE_SELECTIONS)}",
            )
            return
        record = self.track_record()
        pool = mixable_models(self.directory, record)
        routes = await ranked_routes(self.directory, request, pool[:n])
        if policy in ("vote", "judge"):
            floor = self.config.vote_min_temperature
            style = self.config.vote_style if policy == "vote" else "temperature"
            candidates = plan_samples(self.directory, request, n, routes, floor, style, pool)
        elif policy == "single":
            candidates = plan_single(self.directory, request, routes, pool)
        else:
            candidates = plan_candidates(self.directory, request, self.config, routes, pool)
        if not candidates:
            yield Error("unavailable", "model 'mesh' needs at least one model in the mesh")
            return
        config = dataclasses.replace(self.config, judge_select=select)
        win_rates = {c.name: self.standing(c.model.id, record) for c in candidates}
        run = _Run(self, request, candidates, policy, auto, config, win_rates)
        try:
            async for event in run.events():
                yield event
        finally:
            await run.close()


def vote_schedule(directory: ModelDirectory, candidates: list[Candidate]) -> str:
    """``batch`` – every sample at once, stopped when the vote is decided – when every node
    serving the samples' models is idle (the directory says so: a mesh's does); else ``waves``
    (the next wave only for an undecided vote), which adds no more than it needs to a busy mesh.
    On six held-out families one batch took 3.1x greedy's median time against 4.2x in waves
    (bench/results/moa-heldout.md)."""
    all_idle = getattr(directory, "all_idle", None)
    if all_idle is None:
        return "waves"
    models = {c.model.id for c in candidates}
    return "batch" if all(all_idle(m) for m in models) else "waves"


class _Run:
    """One ``mesh`` request in flight: the pump tasks, their buffers and the arbiter."""

    def __init__(
        self,
        moa: MixtureOfAgents,
        request: ChatRequest,
        candidates: list[Candidate],
        policy: Policy,
        auto: str | None = None,
        config: MoaConfig | None = None,
        win_rates: Mapping[str, float] | None = None,
    ) -> None:
        """``config``: the node's, with the request's overrides; ``win_rates``: each
        candidate's standing in the race's score (:meth:`MixtureOfAgents.standing`)."""
        self.moa = moa
        self.config = config or moa.config
        self.clock = moa.clock
        self.request = request
        self.candidates = candidates
        self.policy = policy
        self.auto = auto
        self.queue: asyncio.Queue[tuple[str, Event | _StreamBroke]] = asyncio.Queue()
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.buffers: dict[str, list[Event]] = {}
        self.started_at = self.clock()
        self.schedule = vote_schedule(moa.directory, candidates) if policy == "vote" else None
        self.arbiter = Arbiter(
            [c.name for c in candidates],
            self.config,
            now=self.started_at,
            policy=policy,
            win_rates=win_rates,
            preferred=candidates[0].name if _self_mixture(candidates) else None,
            wave=len(candidates) if self.schedule == "batch" else self.config.vote_wave,
            question=last_user_text(request),
        )
        self.by_name = {c.name: c for c in candidates}

    def _start(self, worker: str, upstream: Upstream, request: ChatRequest) -> list[Decision]:
        self.buffers[worker] = []
        self.tasks[worker] = asyncio.create_task(
            _pump(worker, upstream, request, self.queue), name=f"moa-{worker}"
        )
        # A lone worker is committed as soon as it starts.
        return self.arbiter.handle(WorkerStarted(worker), self.clock())

    def _cancel(self, worker: str) -> None:
        self.buffers.pop(worker, None)
        task = self.tasks.get(worker)
        if task is not None:
            task.cancel()

    async def _next(self, deadline: float | None) -> tuple[str, Event | _StreamBroke] | None:
        """The next queued item, or None when ``deadline`` (clock time) passes first."""
        if not self.queue.empty() or deadline is None:
            return await self.queue.get()
        try:
            async with asyncio.timeout(max(0.0, deadline - self.clock())):
                return await self.queue.get()
        except TimeoutError:
            return None

    async def events(self) -> AsyncIterator[Event]:  # noqa: C901 - to be split (complexity gate, issue 10)
        decisions: list[Decision] = []
        for name in self.arbiter.started():  # vote: the first wave; the others wait for Launch
            c = self.by_name[name]
            decisions += self._start(c.name, c.upstream, c.request)
        # What is known now goes out at once (before any progress note), so it reaches the
        # response headers even when the decision comes later than the gateway can wait.
        yield Meta(self._known_headers())
        if self.config.progress:
            # A note, not reasoning: no text may reach the client before the commit.
            yield Progress(f"asking {len(self.tasks)} models…")
        winner = None
        while True:
            # Cancels first, so a loser stops before the winner's buffer is flushed.
            todo = sorted(decisions, key=lambda d: not isinstance(d, Cancel))
            while todo:
                match todo.pop(0):
                    case Cancel(worker=loser):
                        self._cancel(loser)
                    case StartReducer() as start:
                        todo += self._start_reducer(start)
                    case StartJudge() as start:
                        todo += self._start_judge(start)
                    case Launch(workers=wave):
                        for name in wave:
                            c = self.by_name[name]
                            todo += self._start(c.name, c.upstream, c.request)
                    case Fail(kind=kind, message=message):
                        yield Error(kind, message)
                        return
                    case Commit(worker=chosen):
                        winner = chosen
            if winner is not None:
                break
            item = await self._next(self.arbiter.next_deadline())
            now = self.clock()
            if item is None:
                decisions = self.arbiter.tick(now)
                continue
            worker, event = item
            if worker not in self.buffers:  # a cancelled worker's last words
                decisions = []
                continue
            if not isinstance(event, _StreamBroke):
                self.buffers[worker].append(event)
            seen = _worker_event(worker, event)
            decisions = self.arbiter.handle(seen, now) if seen else []
        async for event in self._splice(winner):
            yield event

    def _known_headers(self) -> dict[str, str]:
        """What is known before the decision: the policy (and the auto rule), the fan-out."""
        # Candidates started so far: the vote's later waves only once launched (no reducer).
        started = sum(1 for name in self.tasks if name in self.by_name)
        headers = {"x-moa-policy": self.policy, "x-moa-workers": str(started)}
        if self.auto is not None:
            headers["x-moa-auto"] = self.auto
        if self.schedule is not None:
            headers["x-moa-vote-schedule"] = self.schedule
        reasons = [f"{c.name}={c.reason}" for c in self.candidates if c.reason]
        if reasons:  # where the mesh sent each candidate, and why (cache-aware routing)
            headers["x-moa-routes"] = ", ".join(reasons)
        return headers

    def _strongest(self) -> tuple[ModelInfo, Upstream]:
        """The mesh's largest model and its first route: the aggregator's and the judge's."""
        model = strongest(mixable_models(self.moa.directory))
        return model, self.moa.directory.routes(model.id)[0].upstream

    def _start_reducer(self, decision: StartReducer) -> list[Decision]:
        model, upstream = self._strongest()
        request = reducer_request(self.request, decision.answers, model)
        return self._start(decision.worker, upstream, request)

    def _start_judge(self, decision: StartJudge) -> list[Decision]:
        model, upstream = self._strongest()
        request = judge_request(self.request, [text for _, text in decision.options], model)
        return self._start(decision.worker, upstream, request)

    def _record(self) -> None:
        """What this decision says of each model: its ballots against the decided answer (the
        vote), its openings through the gates (the race)."""
        model_of = {c.name: c.model.id for c in self.candidates}
        if self.policy == "vote":
            tally = self.arbiter.tally
            decided = tally.winner()
            if decided is not None:
                ballots = [(model_of[b.candidate], b.answer) for b in tally.ballots if b.candidate in model_of]  # fmt: skip
                self.moa.record.record_vote(ballots, decided.answer)
        elif self.policy == "race":
            views = [v for v in self.arbiter.workers.values() if v.name in model_of and v.text]
            self.moa.record.record_openings(
                [(model_of[v.name], v.verdict() is Verdict.PASS) for v in views]
            )

    async def _splice(self, winner: str) -> AsyncIterator[Event]:
        arbiter = self.arbiter
        self.moa.wins.record(
            [c.model.id for c in self.candidates],
            next((c.model.id for c in self.candidates if c.name == winner), None),
        )
        self._record()
        decided_s = (arbiter.decided_at or self.started_at) - self.started_at
        decided = self._known_headers() | decision_headers(arbiter, winner, decided_s)
        reason = self.by_name[winner].reason if winner in self.by_name else None
        if reason:  # the winner's node, as requests.jsonl records a routed request's
            decided[ROUTE_REASON_HEADER] = reason
        yield Meta(decided)
        for buffered in self.buffers.pop(winner, []):
            if not isinstance(buffered, Meta):
                yield buffered
            if is_terminal(buffered):
                return
        self.buffers[winner] = []  # keep accepting the winner's live events
        view = arbiter.workers[winner]
        finish_by = view.started_at + self.config.total_timeout_s
        # A survivor (or a lone worker) can be committed before its first token: the
        # first-token deadline still holds until one comes.
        silent = view.first_token_at is None
        while True:
            first_token_by = view.started_at + self.config.first_token_timeout_s
            item = await self._next(min(first_token_by, finish_by) if silent else finish_by)
            if item is None:
                yield Error("timeout", self._timeout_message(winner, silent))
                return
            worker, event = item
            if worker != winner:
                continue
            silent = silent and not isinstance(event, _CONTENT)
            if isinstance(event, _StreamBroke):
                yield Error("upstream", f"MoA winner {winner} failed: {event.reason}")
                return
            if not isinstance(event, Meta):
                yield event
            if is_terminal(event):
                return

    def _timeout_message(self, winner: str, silent: bool) -> str:
        if silent:
            return (
                f"MoA winner {winner}: no first token within {self.config.first_token_timeout_s:g}s"
            )
        return f"MoA winner {winner} did not finish in time"

    async def close(self) -> None:
        """Cancel every worker still running and wait until each has closed its stream."""
        pending = [task for task in self.tasks.values() if not task.done()]
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
