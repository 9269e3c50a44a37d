"""Responses API state, on top of the stateless encoders in :mod:`gateway.responses.wire`:

- ``store``/``state``: stored responses (SQLite in the node's home) and where they live (this
  node or, through ``mesh``, the node that stored them);
- ``stored``: ``previous_response_id``, retrieval, input items, deletion;
- ``background``: ``background: true`` runs, polling, resumable streams, cancel;
- ``compact``/``compacted``: ``POST /v1/responses/compact`` and its item;
- ``websocket``: WebSocket mode.
"""
