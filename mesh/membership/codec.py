"""orjson + pydantic codec for a union of control messages (handshake, gossip).

Both ride the tunnel's control stream, either as bytes or as a dict inside a Control frame.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import orjson
from pydantic import TypeAdapter, ValidationError

M = TypeVar("M")


class MessageCodec(Generic[M]):
    """Validates and (de)serialises one message union; bad input raises ``error`` only."""

    def __init__(self, union: Any, error: type[Exception], what: str) -> None:
        self._adapter: TypeAdapter[M] = TypeAdapter(union)
        self._error = error
        self._what = what

    def encode(self, message: M) -> bytes:
        return orjson.dumps(message.model_dump())  # type: ignore[attr-defined]

    def from_dict(self, data: dict) -> M:
        """Parse a message carried as a dict (the tunnel's Control frame body)."""
        try:
            return self._adapter.validate_python(data)
        except ValidationError as exc:
            raise self._error(f"bad {self._what}: {exc.error_count()} errors") from exc

    def decode(self, data: bytes) -> M:
        try:
            return self._adapter.validate_python(orjson.loads(data))
        except (orjson.JSONDecodeError, ValidationError) as exc:
            raise self._error(f"bad {self._what}: {exc.__class__.__name__}") from exc
