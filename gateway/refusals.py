"""The refusals a request meets before it runs, whatever its API: the body is not a valid request
(:class:`RequestInvalid`, 400) or a stored response it names cannot be used
(:class:`ResponseStateError`, 404 or 503).

They sit below both the APIs that raise them and the shared request lifetime
(:mod:`gateway.exchange`) that turns them into answers, so the lifetime imports no API.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from gateway.errors import GatewayError
from gateway.events import Error


class RequestInvalid(GatewayError):
    """The client's body is not a valid request for its API (400)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def to_error(self) -> Error:
        return Error(kind="invalid_request", message=self.message, details={"param": self.param})

    @classmethod
    def from_validation(cls, exc: ValidationError, value: Any, at: str = "") -> RequestInvalid:
        """The most specific error, named by its dotted path in the body. ``value`` is what was
        validated (found at ``at`` in the body: a block validated on its own still reports
        ``messages.0.content.1``)."""
        paths = [(_body_path(error, value), error) for error in exc.errors()]
        path, first = max(paths, key=lambda found: len(found[0]))  # the first of the deepest
        where = ".".join([at, *path] if at else path)
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        return cls(f"{where}: {first['msg']}{more}", param=where or None)


def _body_path(error: ErrorDetails, value: Any) -> list[str]:
    """The error's place in the body: its ``loc`` without the labels pydantic adds for union
    members (``content.str``, ``content.list[TextPart].0``). A step is a key or an index of the
    value there, or the name of a missing field; anything else is such a label."""
    path: list[str] = []
    loc = error["loc"]
    for n, step in enumerate(loc):
        if isinstance(value, dict) and step in value:
            value = value[step]
        elif isinstance(value, list) and isinstance(step, int) and 0 <= step < len(value):
            value = value[step]
        elif not (error["type"] == "missing" and n == len(loc) - 1):
            continue
        path.append(str(step))
    return path


_Model = TypeVar("_Model", bound=BaseModel)


def validated(model: type[_Model], value: Any, at: str = "") -> _Model:
    """``value`` (one item or block of a body, found at ``at``) as ``model``, or a 400 naming
    where it is wrong. For parts whose schema depends on their ``type``: look the model up by the
    type, then validate the part with it."""
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        raise RequestInvalid.from_validation(exc, value, at) from exc


class ResponseStateError(GatewayError):
    """A stored response cannot be used: carries the ``Error`` to answer with (the Responses
    API's ``previous_response_id`` and retrieval: not found, or its node unreachable)."""

    def __init__(self, error: Error) -> None:
        super().__init__(error.message)
        self.error = error
