"""The root of the gateway's exceptions. Every error the gateway raises on purpose is a
``GatewayError``, and each becomes an answer in the client's API shape at the edge::

    GatewayError
    ├── RequestInvalid       the client's body is not a valid request for its API (400)
    │                        – gateway/refusals.py, with the field path it names
    ├── ResponseStateError   a stored response cannot be used: not found (404), or the node
    │                        that stored it cannot be reached (503)
    │                        – gateway/refusals.py (made in gateway/responses/state.py),
    │                        carrying the ``Error`` to answer with
    ├── RouteError           no route for the model: unknown (404) or nobody up (503)
    │                        – gateway/router.py, carrying the ``Error`` to answer with
    └── EventDecodeError     a serialised event that is not one of ours (a peer's bad JSON)
                             – gateway/events.py

Every subclass defined in gateway/ is drawn here (tests/unit/gateway/test_error_tree.py checks).
Upstream failures are not exceptions: every upstream ends its stream with an ``Error`` event,
and anything an upstream raises instead is translated into one by the router.
"""

from __future__ import annotations


class GatewayError(Exception):
    """Root of every error the gateway raises on purpose."""
