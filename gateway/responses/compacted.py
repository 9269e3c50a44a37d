"""Text a client carries for the mesh in an ``encrypted_content`` field, and how it is read back:
the ``compaction`` item's summary – or the history it left as it was – and a reasoning item's
reasoning (``include: ["reasoning.encrypted_content"]``, so a client that stores nothing,
``store: false``, still hands the model its reasoning back on the next turn).

``encrypted_content`` is *encoded*, not encrypted (a versioned prefix, ``mlxmesh-compaction-v1.``,
``mlxmesh-history-v1.`` or ``mlxmesh-reasoning-v1.``, + base64 of the zlib'd text): every node
can read it back, and so could the client; it holds nothing the client did not send or receive.
Read back, a summary's compaction item is one user turn carrying the summary; a history's is the
items it carries, read as if the client had sent them.
"""

from __future__ import annotations

import base64
import contextlib
import zlib
from typing import Any

import orjson

from gateway.refusals import RequestInvalid
from gateway.request import Message

PREFIX = "mlxmesh-compaction-v1."
HISTORY_PREFIX = "mlxmesh-history-v1."
REASONING_PREFIX = "mlxmesh-reasoning-v1."
SUMMARY_HEADER = "Summary of the conversation so far:"


def _encode(prefix: str, text: str) -> str:
    return prefix + base64.urlsafe_b64encode(zlib.compress(text.encode())).decode()


def _decode(prefix: str, content: str) -> str | None:
    if not content.startswith(prefix):
        return None
    with contextlib.suppress(ValueError, zlib.error):
        return zlib.decompress(base64.urlsafe_b64decode(content[len(prefix) :])).decode()
    return None


def encode_summary(text: str) -> str:
    return _encode(PREFIX, text)


def decode_summary(content: str) -> str | None:
    """The summary inside a compaction item, or None when it is not one of ours."""
    return _decode(PREFIX, content)


def encode_history(items: list[dict[str, Any]]) -> str:
    """A compaction that replaced nothing: the history's items, as they were."""
    return _encode(HISTORY_PREFIX, orjson.dumps(items).decode())


def decode_history(content: str) -> list[dict[str, Any]] | None:
    """The items a history's compaction item carries, or None when it carries none."""
    text = _decode(HISTORY_PREFIX, content)
    if text is None:
        return None
    with contextlib.suppress(orjson.JSONDecodeError):
        items = orjson.loads(text)
        if isinstance(items, list) and all(isinstance(i, dict) for i in items):
            return items
    return None


def encode_reasoning(text: str) -> str:
    return _encode(REASONING_PREFIX, text)


def decode_reasoning(content: str) -> str | None:
    """The reasoning inside a reasoning item's ``encrypted_content``, or None when it is not
    one of ours (another server's really is encrypted: there is nothing here to read)."""
    return _decode(REASONING_PREFIX, content)


def summary_message(content: str, where: str) -> Message:
    """A compaction item as the model reads it: one user turn carrying the summary."""
    summary = decode_summary(content)
    if summary is None:
        raise RequestInvalid(
            f"{where}.encrypted_content: not a compaction made by this mesh",
            f"{where}.encrypted_content",
        )
    return Message(role="user", content=f"{SUMMARY_HEADER}\n{summary}")
