"""Ends an answer that is stuck in a loop.

Small models at a low temperature fall into loops (SmolLM2-135M at its recommended 0.2 writes
"This is a custom task that can be used to create a new task list." again and again), and an
agent harness asks for up to 32,000 tokens: at a few tokens a second that is many minutes of
the same sentence before ``max_tokens`` ends it. A loop here is exact: the last ``span`` tokens
are one block of at most ``span // 4`` tokens repeated back to back (so at least four times).
The engine then ends the answer as if the model had stopped (``finish_reason: "stop"``), which
ends an agent's turn instead of asking it to continue. ``EngineConfig.loop_guard_tokens = 0``
(``python -m worker --loop-guard 0``, or ``MLX_MESH_LOOP_GUARD=0`` for every worker a node
starts) turns it off.

Pure and incremental: per token one comparison per candidate period.
"""

from __future__ import annotations

import os
from collections import deque

DEFAULT_SPAN = 256
SPAN_ENV = "MLX_MESH_LOOP_GUARD"  # tokens; 0 turns the guard off


def configured_span() -> int:
    """The span to use: ``$MLX_MESH_LOOP_GUARD`` when set (the test suite and the fault lab set
    0: their random-weight models loop under greedy decoding, and their streams must go on),
    else :data:`DEFAULT_SPAN`."""
    value = os.environ.get(SPAN_ENV, "").strip()
    try:
        return max(0, int(value)) if value else DEFAULT_SPAN
    except ValueError:
        return DEFAULT_SPAN


class LoopGuard:
    def __init__(self, span: int = DEFAULT_SPAN, max_period: int = 64) -> None:
        self.span = span
        self.max_period = max(1, min(max_period, span // 4))
        self._recent: deque[int] = deque(maxlen=self.max_period)  # newest last
        # _runs[p]: how many of the newest tokens each equal the token p places before them.
        self._runs = [0] * (self.max_period + 1)
        self.period: int | None = None  # the loop's period, once found

    def feed(self, token: int) -> bool:
        """Add the next generated token; True when the answer is now looping."""
        recent, runs = self._recent, self._runs
        for period in range(1, len(recent) + 1):
            runs[period] = runs[period] + 1 if recent[-period] == token else 0
            if runs[period] + period >= self.span:
                self.period = period
                return True
        recent.append(token)
        return False
