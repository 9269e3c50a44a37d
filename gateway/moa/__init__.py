"""Mixture-of-agents behind ``model="mesh"``: ask several workers, splice the winner's live stream.

- :mod:`~gateway.moa.config` – ``MoaConfig``.
- :mod:`~gateway.moa.knobs` – thinking off unless the caller opted in.
- :mod:`~gateway.moa.candidates` – which worker calls to make; the aggregator prompt.
- :mod:`~gateway.moa.gates`, :mod:`~gateway.moa.scoring` – pure quality checks and scores.
- :mod:`~gateway.moa.answers`, :mod:`~gateway.moa.vote` – final answers and the vote's tally.
- :mod:`~gateway.moa.auto` – which policy a request gets when it names none (``auto``).
- :mod:`~gateway.moa.arbiter` – the pure policy object (race / consensus / reduce / vote).
- :mod:`~gateway.moa.costs` – the decision's ``x-moa-*`` headers.
- :mod:`~gateway.moa.upstream` – ``MixtureOfAgents``, the asyncio orchestrator (an Upstream).
"""

from gateway.moa.config import POLICIES, MoaConfig, Policy
from gateway.moa.upstream import MixtureOfAgents

__all__ = ["POLICIES", "MixtureOfAgents", "MoaConfig", "Policy"]
