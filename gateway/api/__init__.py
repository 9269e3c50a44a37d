"""The stateless client APIs, one module each (Chat, Anthropic Messages and its token count):
parse a body into a ``ChatRequest`` and encode internal events into the API's wire format
(stream frames or a whole body); and what every API shares (error bodies, system-message
placement, output formats). The Responses API, which keeps state, is its own room,
:mod:`gateway.responses`, built on this one."""
