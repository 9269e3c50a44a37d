"""Internal stream events: what every upstream yields and every API encoder consumes.

An upstream stream is any number of deltas, ``Progress`` notes and ``Usage`` events, closed by
exactly one terminal event: ``Done`` or ``Error``. Encoders rely on that terminal event to end
their stream. The last ``Usage`` counts; an earlier one, right before the first delta, tells the
prompt's size early (Anthropic's ``message_start``), and a streamed answer's later ones the
tokens so far (what the request log counts when the client leaves before the end). A worker
also says, once, before its ``Done``, the ``Sampling`` values it generated with (the model's
defaults for what the request left out); like ``Usage`` it is a fact about the answer, not
content.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from gateway.errors import GatewayError

FinishReason = Literal["stop", "length", "tool_calls", "content_filter"]


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One answer token's log-probability (Chat ``logprobs``) and, when the request asked for
    ``top_logprobs``, the most likely tokens at its position, most likely first (their own
    ``top_logprobs`` empty)."""

    token: str
    logprob: float
    top_logprobs: tuple[TokenLogprob, ...] = ()

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> TokenLogprob:
        """The entry from its JSON form (a tunnel frame: orjson writes the fields as keys)."""
        top = tuple(cls.from_wire(t) for t in data.get("top_logprobs") or ())
        return cls(str(data["token"]), float(data["logprob"]), top)


@dataclass(frozen=True, slots=True)
class TextDelta:
    text: str
    # Mean log-probability of the tokens in this delta, when the upstream knows it (MoA scoring).
    # Set whenever ``logprobs`` is: a delta without it counts as a plain one that the tunnel
    # may shorten and merge (mesh/tunnel_server.py, mesh/delta_merge.py).
    logprob: float | None = None
    # The delta's tokens, one entry each, when the request asked for logprobs.
    logprobs: tuple[TokenLogprob, ...] | None = None

    def __post_init__(self) -> None:
        if self.logprobs and self.logprob is None:
            mean = sum(e.logprob for e in self.logprobs) / len(self.logprobs)
            object.__setattr__(self, "logprob", mean)


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """One fragment of a tool call. ``id`` and ``name`` are set on the call's first fragment."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(frozen=True, slots=True)
class Progress:
    """A note on what the upstream is doing before its answer starts ("asking 3 models…").

    Not content: it never commits a route or starts an answer. Responses clients get it as a
    reasoning summary; APIs without a summary channel drop it.
    """

    text: str


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Sampling:
    """The sampling values the answer was generated with (Responses reports them)."""

    temperature: float
    top_p: float
    top_k: int = 0


@dataclass(frozen=True, slots=True)
class Meta:
    """Route facts for response headers and metrics (``x-route``, ``x-moa-winner`` …).

    Not content: encoders never write it; the gateway adds its headers if they are not yet sent.
    """

    headers: dict[str, str]


@dataclass(frozen=True, slots=True)
class Done:
    finish_reason: FinishReason = "stop"
    # The request's stop string that ended the answer (Anthropic ``stop_sequence``); None when
    # the model stopped on its own, hit a limit, or the upstream does not say.
    stop_sequence: str | None = None


ErrorKind = Literal[
    "invalid_request",  # 400
    "authentication",  # 401
    "forbidden",  # 403
    "not_found",  # 404
    "too_large",  # 413
    "misdirected",  # 421
    "overloaded",  # 429
    "unavailable",  # 503
    "upstream",  # 502
    "timeout",  # 504
    "cancelled",
    "internal",  # 500
]

STATUS_BY_KIND: dict[str, int] = {
    "invalid_request": 400,
    "authentication": 401,
    "forbidden": 403,
    "not_found": 404,
    "too_large": 413,
    "misdirected": 421,
    "overloaded": 429,
    "unavailable": 503,
    "upstream": 502,
    "timeout": 504,
    "cancelled": 499,
    "internal": 500,
}


# The answers an upstream (worker or peer) may pass on to the client as they are. Anything else
# is the upstream's own failure (502): a 401 from a worker or peer means OUR credentials were
# wrong, not the client's, and a 500 there is a bug there.
_PASSED_ON = ("invalid_request", "not_found", "too_large", "overloaded", "unavailable", "timeout")
_KIND_BY_STATUS: dict[int, ErrorKind] = {STATUS_BY_KIND[kind]: kind for kind in _PASSED_ON}  # type: ignore[misc]
RETRYABLE_KINDS = frozenset({"overloaded", "unavailable"})


def kind_for_status(status: int) -> ErrorKind:
    """The error kind of an upstream's HTTP ``status`` (the inverse of ``Error.status``)."""
    return _KIND_BY_STATUS.get(status, "upstream")


@dataclass(frozen=True, slots=True)
class Error:
    """Terminal failure. ``retryable`` is true only when nothing was processed upstream."""

    kind: ErrorKind
    message: str
    retryable: bool = False
    code: str | None = None
    details: dict = field(default_factory=dict)

    @property
    def status(self) -> int:
        return STATUS_BY_KIND.get(self.kind, 500)


@dataclass(frozen=True, slots=True)
class ChoiceEvent:
    """One event of choice ``index`` of a request for several answers (Chat ``n > 1``).

    Gateway-local: the fan-out (gateway/choices.py) wraps each choice's events in it, and only
    an API that asked for choices reads it. It never crosses the tunnel (a peer serves each
    choice as a request of its own) and is never terminal: the fan-out ends with a plain
    ``Done`` or ``Error`` for the whole request.
    """

    index: int
    event: Event


Delta = ReasoningDelta | TextDelta | ToolCallDelta
Terminal = Done | Error
Event = (
    ReasoningDelta
    | TextDelta
    | ToolCallDelta
    | Progress
    | Usage
    | Sampling
    | Meta
    | Done
    | Error
    | ChoiceEvent
)

_EVENT_TYPES: dict[str, type] = {
    "reasoning": ReasoningDelta,
    "text": TextDelta,
    "tool_call": ToolCallDelta,
    "progress": Progress,
    "usage": Usage,
    "sampling": Sampling,
    "meta": Meta,
    "done": Done,
    "error": Error,
}
_TYPE_NAMES = {cls: name for name, cls in _EVENT_TYPES.items()}


class EventDecodeError(GatewayError):
    """A serialised event that is not one of ours (tunnel peers send these as JSON)."""


def is_terminal(event: Event) -> bool:
    return isinstance(event, Done | Error)


def event_to_dict(event: Event) -> dict:
    """Plain-dict form for the wire (the tunnel carries one orjson object per event)."""
    out = {"t": _TYPE_NAMES[type(event)]}
    for name in event.__slots__:
        out[name] = getattr(event, name)
    return out


def _token_logprobs(entries: Any) -> tuple[TokenLogprob, ...] | None:
    return None if entries is None else tuple(TokenLogprob.from_wire(e) for e in entries)


# Fields whose JSON form is not the value itself (nested dataclasses), by event type.
_FIELD_DECODERS: dict[tuple[type, str], Callable[[Any], Any]] = {
    (TextDelta, "logprobs"): _token_logprobs,
}


def event_from_dict(data: dict) -> Event:
    try:
        cls = _EVENT_TYPES[data["t"]]
        fields = {k: _FIELD_DECODERS.get((cls, k), _same)(v) for k, v in data.items() if k != "t"}
        return cls(**fields)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise EventDecodeError(f"not an event: {data!r:.200}") from exc


def _same(value: Any) -> Any:
    return value
