"""A chat request becomes a job and the job becomes the wire: the request schemas, the chat
template's rendering, thinking and response_format, the job's deltas (text, reasoning, tool
calls) and their SSE/JSON encoding."""
