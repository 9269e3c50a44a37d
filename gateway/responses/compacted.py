"""The ``compaction`` item's content, and how the model reads it back.

``encrypted_content`` is *encoded*, not encrypted (``mlxmesh-compaction-v1.`` + base64 of the
zlib'd summary): every node can read it back, and so could the client; it holds nothing the
client did not send or receive. Read back, the item is one user turn carrying the summary.
"""

from __future__ import annotations

import base64
import contextlib
import zlib

from gateway.api.errors import RequestInvalid
from gateway.request import Message

PREFIX = "mlxmesh-compaction-v1."
SUMMARY_HEADER = "Summary of the conversation so far:"


def encode_summary(text: str) -> str:
    return PREFIX + base64.urlsafe_b64encode(zlib.compress(text.encode())).decode()


def decode_summary(content: str) -> str | None:
    """The summary inside a compaction item, or None when it is not one of ours."""
    if not content.startswith(PREFIX):
        return None
    with contextlib.suppress(ValueError, zlib.error):
        return zlib.decompress(base64.urlsafe_b64decode(content[len(PREFIX) :])).decode()
    return None


def summary_message(content: str, where: str) -> Message:
    """A compaction item as the model reads it: one user turn carrying the summary."""
    summary = decode_summary(content)
    if summary is None:
        raise RequestInvalid(
            f"{where}.encrypted_content: not a compaction made by this mesh",
            f"{where}.encrypted_content",
        )
    return Message(role="user", content=f"{SUMMARY_HEADER}\n{summary}")
