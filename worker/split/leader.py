"""Rank 0's side of a split group: its model announces each forward pass, under a deadline.

:class:`LeaderModel` is the model rank 0's engine runs: before each pass it tells the followers
(through the :class:`~worker.split.lockstep.Lockstep`) which of their caches to run on;
:class:`StepWatch` ends the process when a step of the group hangs or the ring breaks.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from worker.split.cache import BATCH_TAG, CacheLedger, SplitCacheError, record_batches
from worker.split.lockstep import Lockstep, Op
from worker.split.pipeline import Wrapper
from worker.split.signals import WAKE_LINE

BROKEN_GRACE_S = 1.0  # rank 0 exits this long after the ring broke: its error events go out


class SplitRankError(Exception):
    """Rank 0 was asked for something the followers cannot mirror (a foreign cache or batch, a
    shallow copy run on)."""


class StepWatch:
    """Rank 0's per-step deadline. A collective waits forever for a stopped or wedged peer, so
    every forward pass of the group runs under a deadline (``base_s`` plus ``per_token_s`` per
    token: a long prefill chunk may take longer than a decoded token). When one is missed, or
    the ring reports a peer gone (:meth:`broken`), ``on_overdue`` runs on the watch's own
    thread: the process exits, so its HTTP streams end (the gateway turns a lost worker into an
    error event) and the supervisor re-forms the group.

    The first ``cold_steps`` get ``cold_s`` instead: they read weights on first use and
    compile kernels (~1 s each on the Linux CPU backend), which must not break a new group.

    ``overdue(now)`` is the pure core; :meth:`start` runs it on a daemon thread."""

    def __init__(
        self,
        base_s: float,
        per_token_s: float,
        on_overdue: Callable[[str], None],
        *,
        cold_steps: int = 8,
        cold_s: float = 120.0,
    ) -> None:
        self.base_s = base_s
        self.per_token_s = per_token_s
        self.cold_steps = cold_steps
        self.cold_s = cold_s
        self._steps = 0
        self._on_overdue = on_overdue
        self._deadline: float | None = None
        self._why = ""
        self._broken = False
        self._lock = threading.Lock()

    def begin(self, tokens: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            if not self._broken:
                self._steps += 1
                base = self.cold_s if self._steps <= self.cold_steps else self.base_s
                self._deadline = now + base + self.per_token_s * tokens
                self._why = f"a {tokens}-token step missed its deadline"

    def end(self) -> None:
        with self._lock:
            if not self._broken:
                self._deadline = None

    def broken(self, why: str, grace_s: float, now: float | None = None) -> None:
        """The group is broken: give the engine ``grace_s`` to send its error events, then go."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if not self._broken:
                self._broken = True
                self._deadline = now + grace_s
                self._why = why

    def overdue(self, now: float) -> str | None:
        with self._lock:
            if self._deadline is not None and now >= self._deadline:
                return self._why
            return None

    def start(self, tick_s: float = 0.1) -> None:
        def watch() -> None:
            while (why := self.overdue(time.monotonic())) is None:
                time.sleep(tick_s)
            self._on_overdue(why)

        threading.Thread(target=watch, name="split-step-watch", daemon=True).start()


class LeaderModel(Wrapper):
    """Rank 0's model as the engine sees it: each forward pass is announced to the followers
    first, as a :class:`Step` of the group's :class:`CacheLedger` (worker/split/cache.py: which
    of their caches it runs on, copied and trimmed how; for a batch, which batch and how
    mlx-lm's ``BatchGenerator`` merged, filtered, extended or split batches since), then run.
    Its caches (:meth:`make_cache`) are marked as its ledger's, so their batches are recorded.
    Everything else (``layers``, parameters) is the wrapped model's."""

    def __init__(
        self,
        model: nn.Module,
        lockstep: Lockstep,
        watch: StepWatch | None = None,
        *,
        doze_after_s: float = 0.0,
    ) -> None:
        super().__init__(model)
        object.__setattr__(self, "_lockstep", lockstep)
        object.__setattr__(self, "_watch", watch)
        object.__setattr__(self, "ledger", CacheLedger())
        object.__setattr__(self, "_doze_after_s", doze_after_s)
        object.__setattr__(self, "_last_pass", time.monotonic())
        object.__setattr__(self, "dozing", False)
        record_batches()

    def make_cache(self) -> list[Any]:
        from mlx_lm.models.cache import make_prompt_cache

        return self.ledger.mark_fresh(make_prompt_cache(self.inner))

    def engine_idle(self, now: float | None = None) -> None:
        """The engine has nothing to do (it calls this between its idle waits). A follower
        waiting in the ring's ``all_sum`` spins a whole core (MLX's ring backend polls), so
        after ``doze_after_s`` without a pass the followers are told to doze: they block on
        their stdin until this node's supervisor, asked by :data:`WAKE_LINE` on the next
        pass, writes them a byte (through the rank's order stream for a rank elsewhere)."""
        now = time.monotonic() if now is None else now
        if self.dozing or not self._doze_after_s or self._lockstep.group is None:
            return
        if now - self._last_pass < self._doze_after_s:
            return
        with self._guarded(tokens=0):
            self._lockstep.send(Op.DOZE)
        object.__setattr__(self, "dozing", True)

    def _wake(self) -> None:
        if self.dozing:
            print(WAKE_LINE, flush=True)
            object.__setattr__(self, "dozing", False)

    @contextlib.contextmanager
    def _guarded(self, tokens: int) -> Iterator[None]:
        """The group's collectives of one step, under its deadline; a broken ring reported."""
        watch = self._watch
        if watch is not None:
            watch.begin(tokens)
        try:
            yield
        except RuntimeError as exc:  # the ring backend's error: a peer is gone
            if watch is not None:
                watch.broken(f"the split group broke ({exc})", grace_s=BROKEN_GRACE_S)
            raise SplitRankError(f"the split group broke: {exc}") from exc
        finally:
            if watch is not None:
                watch.end()

    def __call__(self, inputs: mx.array, cache: Any = None, **kwargs: Any) -> mx.array:
        if cache is None or kwargs.get("input_embeddings") is not None:
            raise SplitRankError("a split model runs token sequences, with a cache")
        batched = BATCH_TAG in cache[0].__dict__
        if not batched and inputs.shape[0] != 1:
            raise SplitRankError("a split model runs a batch only on a batch cache")
        try:
            if batched:
                step = self.ledger.plan_batch(cache, int(inputs.shape[0]))
            else:
                step = self.ledger.plan(cache)
        except SplitCacheError as exc:
            raise SplitRankError(f"a split model cannot run this cache: {exc}") from exc
        # Waits for the sampled tokens: the followers need their values.
        tokens = [int(t) for row in inputs.tolist() for t in row]  # type: ignore[union-attr, arg-type]
        self._wake()
        object.__setattr__(self, "_last_pass", time.monotonic())
        with self._guarded(len(tokens)):
            self._lockstep.send(Op.BATCH if batched else Op.FORWARD, step, tokens)
            if not batched:
                self.ledger.ran(step, len(tokens))
            out = self.inner(inputs, cache=cache)
            # The whole pipeline's round trip, here, under the step's deadline.
            mx.eval([c.state for c in cache])
        return out
