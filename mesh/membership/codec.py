"""pydantic validation for a union of control messages (handshake, gossip).

Both ride the tunnel's control stream as the dict inside a ``Control`` frame (the frame codec
owns the JSON), so a message is parsed from that dict and nothing else.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

from pydantic import TypeAdapter, ValidationError

M = TypeVar("M")


class MessageCodec(Generic[M]):
    """Validates and (de)serialises one message union; bad input raises ``error`` only."""

    def __init__(self, union: Any, error: type[Exception], what: str) -> None:
        self._adapter: TypeAdapter[M] = TypeAdapter(union)
        self._error = error
        self._what = what

    def from_dict(self, data: dict) -> M:
        """Parse a message carried as a dict (the tunnel's Control frame body)."""
        try:
            return self._adapter.validate_python(data)
        except ValidationError as exc:
            raise self._error(f"bad {self._what}: {exc.error_count()} errors") from exc
