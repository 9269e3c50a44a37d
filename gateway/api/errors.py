"""Error bodies in each API's own shape (OpenAI's, Anthropic's), from an internal ``Error``.

The errors a request is refused with are in :mod:`gateway.refusals`."""

from __future__ import annotations

from typing import Any

from gateway.events import Error

_OPENAI_TYPES = {
    "invalid_request": "invalid_request_error",
    "authentication": "authentication_error",
    "forbidden": "permission_error",
    "not_found": "not_found_error",
    "too_large": "invalid_request_error",
    "misdirected": "invalid_request_error",
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
    "forbidden": "permission_error",
    "not_found": "not_found_error",
    "too_large": "request_too_large",
    "misdirected": "invalid_request_error",
    "overloaded": "rate_limit_error",
    "unavailable": "overloaded_error",
    "upstream": "api_error",
    "timeout": "timeout_error",
    "cancelled": "api_error",
    "internal": "api_error",
}


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
