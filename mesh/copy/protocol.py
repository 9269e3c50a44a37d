"""The copy channel's frames. Pure: bytes in, messages out.

Every message is a 4-byte big-endian length and a JSON object. A reply with a body (a manifest,
a chunk) says ``length`` and exactly that many raw bytes follow it. A connection carries any
number of requests, one at a time::

    → {"op": "manifest", "name": "smollm2-135m"}
    ← {"ok": true, "length": 2315}  + 2315 bytes of manifest JSON
    → {"op": "chunk", "name": "smollm2-135m", "path": "model.safetensors", "offset": 0, "length": 8388608}
    ← {"ok": true, "length": 8388608}  + the bytes
    ← {"ok": false, "kind": "unknown_model", "message": "no model named 'x' here"}
"""

from __future__ import annotations

import struct
from typing import Annotated, Literal

import orjson
from pydantic import BaseModel, Field, TypeAdapter, ValidationError

from mesh.copy.manifest import MAX_CHUNK_SIZE
from mesh.errors import CopyError

ALPN = "mlx-mesh-copy/1"
MAX_HEADER = 64 * 1024
# Both ends move a chunk's bytes through one reused buffer of this size: decrypted (or read),
# hashed and written (or encrypted) while still in the CPU's cache. Whole 8 MiB chunk buffers
# made every byte go through memory three times (bench/results/peer_copy.md).
IO_BLOCK = 256 * 1024
_LENGTH = struct.Struct(">I")
PREFIX_SIZE = _LENGTH.size


class ProtocolError(CopyError):
    """Bytes on the copy channel that are not a copy message."""


class ManifestRequest(BaseModel):
    op: Literal["manifest"] = "manifest"
    name: str = Field(min_length=1, max_length=128)


class ChunkRequest(BaseModel):
    op: Literal["chunk"] = "chunk"
    name: str = Field(min_length=1, max_length=128)
    path: str = Field(min_length=1, max_length=1024)
    offset: int = Field(ge=0)
    length: int = Field(gt=0, le=MAX_CHUNK_SIZE)


Request = Annotated[ManifestRequest | ChunkRequest, Field(discriminator="op")]
_REQUEST: TypeAdapter[ManifestRequest | ChunkRequest] = TypeAdapter(Request)


class Reply(BaseModel):
    ok: bool
    length: int = Field(default=0, ge=0)
    kind: str = ""
    message: str = ""


def pack(message: BaseModel) -> bytes:
    """One frame: length prefix + the message's JSON."""
    body = orjson.dumps(message.model_dump(exclude_defaults=False))
    return _LENGTH.pack(len(body)) + body


def header_length(prefix: bytes) -> int:
    """The JSON length a 4-byte prefix announces; refuses absurd sizes before reading them."""
    (length,) = _LENGTH.unpack(prefix)
    if length > MAX_HEADER:
        raise ProtocolError(f"a copy message of {length} bytes is over the {MAX_HEADER} limit")
    return length


def parse_request(raw: bytes) -> ManifestRequest | ChunkRequest:
    try:
        return _REQUEST.validate_json(raw)
    except ValidationError as exc:
        raise ProtocolError(f"not a copy request: {exc.errors()[0]['msg']}") from None


def parse_reply(raw: bytes) -> Reply:
    try:
        return Reply.model_validate_json(raw)
    except ValidationError as exc:
        raise ProtocolError(f"not a copy reply: {exc.errors()[0]['msg']}") from None


def refusal(kind: str, message: str) -> bytes:
    return pack(Reply(ok=False, kind=kind, message=message))


def accept(length: int) -> bytes:
    return pack(Reply(ok=True, length=length))
