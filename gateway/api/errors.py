"""Error bodies in each API's own shape, and request-parse errors that name the problem."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from gateway.events import Error

_OPENAI_TYPES = {
    "invalid_request": "invalid_request_error",
    "authentication": "authentication_error",
    "not_found": "not_found_error",
    "too_large": "invalid_request_error",
    "overloaded": "rate_limit_error",
    "unavailable": "server_error",
    "upstream": "server_error",
    "timeout": "server_error",
    "cancelled": "server_error",
    "internal": "server_error",
}

_ANTHROPIC_TYPES = {
    "invalid_request": "invalid_request_error",
    "authentication": "authentication_error",
    "not_found": "not_found_error",
    "too_large": "request_too_large",
    "overloaded": "rate_limit_error",
    "unavailable": "overloaded_error",
    "upstream": "api_error",
    "timeout": "timeout_error",
    "cancelled": "api_error",
    "internal": "api_error",
}


class RequestInvalid(Exception):
    """The client's body is not a valid request for its API (400)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def to_error(self) -> Error:
        return Error(kind="invalid_request", message=self.message, details={"param": self.param})

    @classmethod
    def from_validation(cls, exc: ValidationError) -> RequestInvalid:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        return cls(f"{where}: {first['msg']}{more}", param=where or None)


def openai_error_body(error: Error) -> dict[str, Any]:
    return {
        "error": {
            "message": error.message,
            "type": _OPENAI_TYPES.get(error.kind, "server_error"),
            "param": error.details.get("param"),
            "code": error.code or error.kind,
        }
    }


def anthropic_error_body(error: Error) -> dict[str, Any]:
    return {
        "type": "error",
        "error": {"type": _ANTHROPIC_TYPES.get(error.kind, "api_error"), "message": error.message},
    }
