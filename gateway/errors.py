"""The root of the gateway's exceptions. Every error the gateway raises on purpose is a
``GatewayError``, and each becomes an answer in the client's API shape at the edge::

    GatewayError
    ├── RequestInvalid     the client's body is not a valid request for its API (400)
    │                      – gateway/refusals.py, with the field path it names
    ├── RouteError         no route for the model: unknown (404) or nobody up (503)
    │                      – gateway/router.py, carrying the ``Error`` to answer with
    └── EventDecodeError   a serialised event that is not one of ours (a peer's bad JSON)
                           – gateway/events.py

Upstream failures are not exceptions: every upstream ends its stream with an ``Error`` event,
and anything an upstream raises instead is translated into one by the router.
"""

from __future__ import annotations


class GatewayError(Exception):
    """Root of every error the gateway raises on purpose."""
