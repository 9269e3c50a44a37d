"""The engine's counters and its throughput window: changed from the owner thread and the event
loop (a submit counts as queued at once), so each change takes one lock, here."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

from worker.engine.types import EngineStats

PREFILL_WINDOW = 16  # prefills the rate is measured over
MIN_PREFILL_TOKENS = 32  # shorter ones measure the step, not the prefill

log = logging.getLogger(__name__)


class Meter:
    """Counts what the engine's jobs do into ``stats`` (read by /health and tests), and the
    decoded tokens of the last seconds (``tokens_per_second``, the load mesh routing reads)."""

    def __init__(self, stats: EngineStats) -> None:
        self.stats = stats
        self._lock = threading.Lock()
        self._rate: deque[tuple[float, int]] = deque()
        # The last prefills' (tokens computed, seconds from admission to first token): the
        # mesh weighs a cached prefix against a cold prefill elsewhere by this rate.
        self._prefills: deque[tuple[int, float]] = deque(maxlen=PREFILL_WINDOW)

    def submitted(self) -> None:
        with self._lock:
            self.stats.queue_depth += 1
            self.stats.submitted += 1

    def first_token(self) -> None:
        """A job gave its first token: from the queue to in flight."""
        with self._lock:
            self.stats.queue_depth -= 1
            self.stats.in_flight += 1

    def left(self, *, first_token: bool, cancelled: bool = False) -> None:
        """A job left, in flight when it gave a token already, else from the queue."""
        with self._lock:
            if first_token:
                self.stats.in_flight -= 1
            else:
                self.stats.queue_depth -= 1
            if cancelled:
                self.stats.cancelled += 1

    def cancelled(self) -> None:
        with self._lock:
            self.stats.cancelled += 1

    def completed(self) -> None:
        with self._lock:
            self.stats.completed += 1

    def loop_stopped(self, job_id: str, period: int, after: int) -> None:
        log.info("job %s: stopped a loop of %d tokens after %d tokens", job_id, period, after)
        with self._lock:
            self.stats.loops_stopped += 1

    def prefill(self, computed: int, shared: int) -> None:
        """A job runs ``computed`` prompt tokens (more than its last one is a prefill) and took
        ``shared`` from a running sibling's KV."""
        with self._lock:
            self.stats.prompt_tokens_computed += computed
            if computed > 1:
                self.stats.prefills += 1
            if shared:
                self.stats.shared_prefills += 1
                self.stats.shared_prefill_tokens += shared

    def prefilled(self, tokens: int, seconds: float) -> None:
        """A row's prefill of ``tokens`` computed prompt tokens gave its first token after
        ``seconds`` (sharing the engine with whatever ran beside it: what a newcomer gets)."""
        if tokens >= MIN_PREFILL_TOKENS and seconds > 0:
            with self._lock:
                self._prefills.append((tokens, seconds))

    def prefill_tokens_per_second(self) -> float | None:
        """Prompt tokens prefilled per second over the last prefills; None before any."""
        with self._lock:
            seconds = sum(s for _, s in self._prefills)
            tokens = sum(n for n, _ in self._prefills)
        return tokens / seconds if seconds > 0 else None

    def decoded(self, tokens: int) -> None:
        with self._lock:
            self._rate.append((time.monotonic(), tokens))
            self.stats.generated_tokens += tokens

    def tokens_per_second(self, window_s: float = 10.0) -> float:
        now = time.monotonic()
        with self._lock:
            while self._rate and now - self._rate[0][0] > window_s:
                self._rate.popleft()
            if not self._rate:
                return 0.0
            tokens = sum(n for _, n in self._rate)
            span = max(now - self._rate[0][0], 1e-3)
        return tokens / span

    def forget_rate(self) -> None:
        with self._lock:
            self._rate.clear()
