"""The OpenAI Responses API, whole: its request, its wire format and the state it keeps. It
builds on what the APIs share in :mod:`gateway.api` (error bodies, output formats) and plugs
into the shared request lifetime (:mod:`gateway.exchange`); neither imports it.

The API itself, stateless:

- ``request``: the body validated and its ``input`` items turned into a ChatRequest;
- ``tools``: the request's ``tools``: what the model is shown, and how its calls go back;
- ``response``: the response object and its output items;
- ``wire``: internal events → stream events (SSE or WebSocket), the whole body, the error body;
  with ``request.parse`` it is what the shared lifetime needs (``ApiSpec``).

The state on top of it:

- ``store``/``state``: stored responses (SQLite in the node's home) and where they live (this
  node or, through ``mesh``, the node that stored them);
- ``stored``: ``previous_response_id``, retrieval, input items, deletion;
- ``background``: ``background: true`` runs, polling, resumable streams, cancel;
- ``compact``/``compacted``: ``POST /v1/responses/compact`` and its item (also the encoded
  reasoning that ``request`` and ``response`` read and write);
- ``websocket``: WebSocket mode.
"""
