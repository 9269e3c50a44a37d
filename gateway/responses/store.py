"""Stored Responses (``store: true``): one SQLite file in the node's home, bounded, oldest first out.

Each row is self-contained: besides the response object and the turn's own input items it keeps
the turn's whole *context* (every input and output item of the chain up to and including this
turn), which is exactly what a continuation with ``previous_response_id`` puts before its new
input. So evicting an old row never breaks a newer chain, and a peer that asks for a response
gets everything it needs in one answer. Blobs are zlib-compressed JSON (conversation text
shrinks 3-5x), which keeps a long agent session's quadratic context cheap.

The store is synchronous (stdlib ``sqlite3`` in WAL mode, one connection): a put or get is well
under a millisecond for ordinary turns, cheaper than a thread hop.
"""

from __future__ import annotations

import sqlite3
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

DEFAULT_MAX_RESPONSES = 10_000
DEFAULT_MAX_BYTES = 256 << 20  # compressed bytes on disk, all rows together

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    created_at REAL NOT NULL,
    status TEXT NOT NULL,
    response BLOB NOT NULL,
    input_items BLOB NOT NULL,
    context BLOB NOT NULL,
    size INTEGER NOT NULL
)
"""


@dataclass
class StoredResponse:
    """One stored turn. ``context`` is what a continuation of it starts from."""

    id: str
    response: dict[str, Any]
    input_items: list[dict[str, Any]] = field(default_factory=list)
    context: list[dict[str, Any]] = field(default_factory=list)
    created_at: float = field(default_factory=time.time)

    @property
    def status(self) -> str:
        return str(self.response.get("status", ""))


def _pack(value: Any) -> bytes:
    return zlib.compress(orjson.dumps(value), 3)


def _unpack(blob: bytes) -> Any:
    return orjson.loads(zlib.decompress(blob))


class ResponseStore:
    """``put``/``get``/``delete`` of :class:`StoredResponse` rows, bounded by count and bytes.

    ``path=None`` keeps the rows in memory (tests, a gateway without a home); a node always
    passes a file in its home.
    """

    def __init__(
        self,
        path: Path | None,
        *,
        max_responses: int = DEFAULT_MAX_RESPONSES,
        max_bytes: int = DEFAULT_MAX_BYTES,
    ) -> None:
        if max_responses < 1 or max_bytes < 1:
            raise ValueError("the response store needs room for at least one response")
        self.path = path
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch(mode=0o600, exist_ok=True)  # conversations are private
        # One connection, used from the event loop (and from test threads): serialise access.
        self._db = sqlite3.connect(
            str(path) if path is not None else ":memory:", check_same_thread=False
        )
        self._lock = threading.Lock()
        with self._lock, self._db:
            if path is not None:
                self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute(_SCHEMA)

    def put(self, item: StoredResponse) -> None:
        """Insert or replace ``item`` (a background response is put again as it progresses),
        then drop the oldest rows until both bounds hold. The newest row always stays."""
        response, inputs, context = (
            _pack(item.response),
            _pack(item.input_items),
            _pack(item.context),
        )
        size = len(response) + len(inputs) + len(context)
        with self._lock, self._db:
            self._db.execute(
                "INSERT INTO responses (id, created_at, status, response, input_items, context,"
                " size) VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT(id) DO UPDATE SET"
                " status=excluded.status, response=excluded.response,"
                " input_items=excluded.input_items, context=excluded.context,"
                " size=excluded.size",
                (item.id, item.created_at, item.status, response, inputs, context, size),
            )
            self._evict()

    def _evict(self) -> None:
        count, total = self._db.execute(
            "SELECT COUNT(*), COALESCE(SUM(size), 0) FROM responses"
        ).fetchone()
        while count > 1 and (count > self.max_responses or total > self.max_bytes):
            seq, size = self._db.execute(
                "SELECT seq, size FROM responses ORDER BY seq LIMIT 1"
            ).fetchone()
            self._db.execute("DELETE FROM responses WHERE seq = ?", (seq,))
            count, total = count - 1, total - size

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            row = self._db.execute(
                "SELECT id, created_at, response, input_items, context FROM responses WHERE id = ?",
                (response_id,),
            ).fetchone()
        if row is None:
            return None
        rid, created_at, response, inputs, context = row
        return StoredResponse(
            id=rid,
            response=_unpack(response),
            input_items=_unpack(inputs),
            context=_unpack(context),
            created_at=created_at,
        )

    def delete(self, response_id: str) -> bool:
        with self._lock, self._db:
            cursor = self._db.execute("DELETE FROM responses WHERE id = ?", (response_id,))
        return cursor.rowcount > 0

    def stats(self) -> dict[str, int]:
        with self._lock:
            count, total = self._db.execute(
                "SELECT COUNT(*), COALESCE(SUM(size), 0) FROM responses"
            ).fetchone()
        return {"responses": count, "bytes": total}

    def fail_unfinished(self, message: str) -> int:
        """Mark every queued or running response failed (a background run does not outlive the
        process that ran it: call this when a node starts). Returns how many."""
        with self._lock:
            rows = self._db.execute(
                "SELECT id FROM responses WHERE status IN ('queued', 'in_progress')"
            ).fetchall()
        for (response_id,) in rows:
            item = self.get(response_id)
            if item is None:
                continue
            error = {"code": "server_error", "message": message}
            item.response = item.response | {"status": "failed", "error": error}
            self.put(item)
        return len(rows)

    def close(self) -> None:
        with self._lock:
            self._db.close()
