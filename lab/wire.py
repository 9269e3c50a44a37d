"""What the probe sends and how it reads the answers, per client API.

Request bodies ask for thinking **off** through each API's own knob. Stream readers are pure:
fed SSE frames, they collect content, token counts and the terminal state, and never do I/O.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import orjson

from lab.rows import ApiName

PATHS: dict[ApiName, str] = {
    "chat": "/v1/chat/completions",
    "responses": "/v1/responses",
    "messages": "/v1/messages",
}


def build_body(
    api: ApiName, model: str, prompt: str, *, stream: bool, max_tokens: int
) -> dict[str, Any]:
    """A temperature-0, thinking-off request in ``api``'s wire shape."""
    if api == "chat":
        body: dict[str, Any] = {
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "temperature": 0,
            "max_tokens": max_tokens,
            "stream": stream,
            "chat_template_kwargs": {"enable_thinking": False},
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body
    if api == "responses":
        return {
            "model": model,
            "input": prompt,
            "temperature": 0,
            "max_output_tokens": max_tokens,
            "stream": stream,
            "reasoning": {"enabled": False},
        }
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0,
        "max_tokens": max_tokens,
        "stream": stream,
        "thinking": {"type": "disabled"},
    }


def build_headers(api: ApiName, api_key: str | None) -> dict[str, str]:
    headers = {"content-type": "application/json", "accept": "application/json"}
    if api == "messages":
        headers["anthropic-version"] = "2023-06-01"
        if api_key:
            headers["x-api-key"] = api_key
    if api_key:
        headers["authorization"] = f"Bearer {api_key}"
    return headers


def sentinel_passed(text: str, word: str) -> bool:
    """True when ``word`` comes back as a whole word (case and punctuation ignored)."""
    return word.lower() in re.findall(r"[a-z0-9]+", text.lower())


def error_message(payload: Any) -> str:
    """The human part of any of the three APIs' error shapes, else the payload's repr."""
    if isinstance(payload, dict):
        err = payload.get("error", payload)
        if isinstance(err, dict):
            message = err.get("message") or err.get("type") or err.get("code")
            if message:
                return str(message)
        elif isinstance(err, str):
            return err
    return repr(payload)[:300]


def parse_nonstream(api: ApiName, payload: dict[str, Any]) -> tuple[str, int | None]:
    """Content text and completion-token count of a non-stream 200 body."""
    if api == "chat":
        choices = payload.get("choices") or [{}]
        text = (choices[0].get("message") or {}).get("content") or ""
        tokens = (payload.get("usage") or {}).get("completion_tokens")
    elif api == "responses":
        text = payload.get("output_text") or "".join(
            part.get("text", "")
            for item in payload.get("output") or []
            if item.get("type") == "message"
            for part in item.get("content") or []
            if part.get("type") == "output_text"
        )
        tokens = (payload.get("usage") or {}).get("output_tokens")
    else:
        text = "".join(
            block.get("text", "")
            for block in payload.get("content") or []
            if block.get("type") == "text"
        )
        tokens = (payload.get("usage") or {}).get("output_tokens")
    return text, tokens if isinstance(tokens, int) else None


@dataclass
class StreamState:
    """What a stream reader learned so far. ``terminal`` is None until the stream ended."""

    text_parts: list[str] = field(default_factory=list)
    content_deltas: int = 0
    usage_tokens: int | None = None
    terminal: str | None = None  # "ok" | "error"
    error: str | None = None

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    @property
    def tokens(self) -> int:
        return self.usage_tokens if self.usage_tokens is not None else self.content_deltas


class StreamReader:
    """Base: ``feed(event, data)`` returns True when the frame carried content (for TTFT)."""

    def __init__(self) -> None:
        self.state = StreamState()

    def feed(self, event: str, data: str) -> bool:
        if self.state.terminal is not None:
            return False  # anything after the terminal event is ignored
        if data == "[DONE]":
            return self._done()
        try:
            payload = orjson.loads(data)
        except orjson.JSONDecodeError:
            self._fail(f"malformed SSE data: {data[:120]!r}")
            return False
        if not isinstance(payload, dict):
            self._fail(f"SSE data is not an object: {data[:120]!r}")
            return False
        return self._payload(event, payload)

    def _content(self, text: str) -> bool:
        if not text:
            return False
        self.state.text_parts.append(text)
        self.state.content_deltas += 1
        return True

    def _fail(self, message: str) -> None:
        self.state.terminal, self.state.error = "error", message

    def _finish(self) -> None:
        self.state.terminal = "ok"

    def _done(self) -> bool:
        self._fail("unexpected [DONE]")
        return False

    def _payload(self, event: str, payload: dict[str, Any]) -> bool:
        raise NotImplementedError


class ChatStreamReader(StreamReader):
    """Chat completions: ``data: {chunk}`` … ``data: [DONE]``; errors as ``{"error": …}``."""

    def _done(self) -> bool:
        if self.state.error is None:
            self._finish()
        else:
            self.state.terminal = "error"
        return False

    def _payload(self, event: str, payload: dict[str, Any]) -> bool:
        if "error" in payload:
            # An error chunk may still be followed by [DONE]; it decides the outcome either way.
            self._fail(error_message(payload))
            return False
        usage = payload.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            self.state.usage_tokens = usage["completion_tokens"]
        carried = False
        for choice in payload.get("choices") or []:
            delta = choice.get("delta") or {}
            carried |= self._content(delta.get("content") or "")
        return carried


class ResponsesStreamReader(StreamReader):
    """OpenAI Responses: named events, ``response.completed`` / ``failed`` / ``error`` end it."""

    def _payload(self, event: str, payload: dict[str, Any]) -> bool:
        kind = payload.get("type") or event
        if kind == "response.output_text.delta":
            return self._content(payload.get("delta") or "")
        if kind in ("response.completed", "response.incomplete"):
            usage = (payload.get("response") or {}).get("usage") or {}
            if isinstance(usage.get("output_tokens"), int):
                self.state.usage_tokens = usage["output_tokens"]
            self._finish()
        elif kind == "response.failed":
            self._fail(error_message((payload.get("response") or {}).get("error") or payload))
        elif kind == "error":
            self._fail(error_message(payload))
        return False


class MessagesStreamReader(StreamReader):
    """Anthropic Messages: ``content_block_delta`` text, ``message_stop`` ends, ``error`` fails."""

    def _payload(self, event: str, payload: dict[str, Any]) -> bool:
        kind = payload.get("type") or event
        if kind == "content_block_delta":
            delta = payload.get("delta") or {}
            if delta.get("type") == "text_delta":
                return self._content(delta.get("text") or "")
        elif kind == "message_delta":
            usage = payload.get("usage") or {}
            if isinstance(usage.get("output_tokens"), int):
                self.state.usage_tokens = usage["output_tokens"]
        elif kind == "message_stop":
            self._finish()
        elif kind == "error":
            self._fail(error_message(payload))
        return False


READERS: dict[ApiName, type[StreamReader]] = {
    "chat": ChatStreamReader,
    "responses": ResponsesStreamReader,
    "messages": MessagesStreamReader,
}


def make_reader(api: ApiName) -> StreamReader:
    return READERS[api]()
