"""The copy server: hands stored models to members over TLS 1.3, chunk by chunk.

One asyncio TCP listener; each connection is upgraded with ``start_tls`` using a context whose
trust anchors are the certificates of the current members (rebuilt when they change), so a
stranger fails the handshake; the presented certificate is then mapped to a node id and checked
against the member table once more. Per connection: a handshake deadline, an idle deadline
between requests and a deadline per reply. Per member: a cap on concurrent connections and an
optional byte-rate limit (a token bucket).

Chunks go out as ``pread`` + ``write``: ``loop.sendfile`` cannot write through an SSL transport
(asyncio falls back to read+write itself) and kTLS is out of scope; ``bench/peer_copy.py``
measures what that costs against raw TCP.

    server = CopyServer(home, identity, trusted=lambda: {node_id: cert_der, ...})
    await server.start()         # server.port
    await server.close()
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import ssl
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from mesh.copy.manifest import CHUNK_SIZE, ModelManifest, build_manifest, stat_signature
from mesh.copy.protocol import (
    PREFIX_SIZE,
    ChunkRequest,
    ManifestRequest,
    ProtocolError,
    accept,
    header_length,
    parse_request,
    refusal,
)
from mesh.copy.tls import make_context, peer_node_id
from mesh.errors import AuthFailed, ManifestError
from mesh.identity import NodeIdentity, short_id
from worker.store import InvalidModelNameError, model_path

log = logging.getLogger(__name__)

TrustSource = Callable[[], dict[str, bytes]]  # node id → certificate DER of members allowed in


@dataclass
class CopyConfig:
    """Where the copy server listens and how much one member may take."""

    host: str = "127.0.0.1"
    port: int = 0
    handshake_timeout_s: float = 10.0
    idle_timeout_s: float = 30.0
    reply_timeout_s: float = 120.0
    max_connections_per_member: int = 8
    rate_bytes_per_s: float | None = None  # per member; None = as fast as the link goes
    chunk_size: int = CHUNK_SIZE


@dataclass
class TokenBucket:
    """Pure byte-rate limiter: :meth:`delay` says how long to wait before sending ``n`` bytes."""

    rate: float
    burst: float
    tokens: float = field(default=0.0)
    at: float | None = None

    def delay(self, n: int, now: float) -> float:
        if self.at is None:
            self.tokens, self.at = self.burst, now
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        self.tokens -= n
        return 0.0 if self.tokens >= 0 else -self.tokens / self.rate


class _Refused(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class CopyServer:
    def __init__(
        self,
        home: Path,
        identity: NodeIdentity,
        trusted: TrustSource,
        config: CopyConfig | None = None,
    ) -> None:
        self.home = Path(home)
        self.identity = identity
        self.trusted = trusted
        self.config = config or CopyConfig()
        self.port: int | None = None
        self.bytes_served = 0
        self.refusals: dict[str, int] = defaultdict(int)
        self._server: asyncio.Server | None = None
        self._context: tuple[frozenset[bytes], ssl.SSLContext] | None = None
        self._manifests: dict[str, tuple[tuple, ModelManifest]] = {}
        self._manifest_locks: dict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._active: dict[str, int] = defaultdict(int)
        self._buckets: dict[str, TokenBucket] = {}
        self._handlers: set[asyncio.Task[None]] = set()
        self._dispatch: dict[type, Callable[..., Awaitable[None]]] = {
            ManifestRequest: self._serve_manifest,
            ChunkRequest: self._serve_chunk,
        }

    async def start(self) -> None:
        self._server = await asyncio.start_server(
            self._on_connection, self.config.host, self.config.port
        )
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("copy server on %s:%d (tls 1.3, members only)", self.config.host, self.port)

    async def close(self) -> None:
        if self._server is None:
            return
        self._server.close()
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(1.0):
                await self._server.wait_closed()
        self._server = None

    def _ssl_context(self, trusted: dict[str, bytes]) -> ssl.SSLContext:
        key = frozenset(trusted.values())
        if self._context is None or self._context[0] != key:
            self._context = (key, make_context(self.identity, key, server=True))
        return self._context[1]

    # ------------------------------------------------------------------ connections

    async def _on_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        peer = writer.get_extra_info("peername")
        try:
            await self._serve_connection(reader, writer)
        except (AuthFailed, ssl.SSLError) as exc:
            self.refusals["not a member"] += 1
            log.warning("copy: refused %s: %s", peer, exc)
        except (OSError, TimeoutError, asyncio.IncompleteReadError, ProtocolError) as exc:
            log.info("copy: connection from %s ended: %s", peer, exc)
        finally:
            self._handlers.discard(task)
            writer.close()
            with contextlib.suppress(OSError, ssl.SSLError, TimeoutError):
                async with asyncio.timeout(1.0):
                    await writer.wait_closed()

    async def _serve_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        trusted = self.trusted()
        await writer.start_tls(
            self._ssl_context(trusted), ssl_handshake_timeout=self.config.handshake_timeout_s
        )
        node_id = peer_node_id(writer.get_extra_info("ssl_object"))
        if node_id not in self.trusted():  # removed since the context was built
            raise AuthFailed(f"{short_id(node_id)} is not a member")
        if self._active[node_id] >= self.config.max_connections_per_member:
            self.refusals["busy"] += 1
            writer.write(refusal("busy", "too many copy connections from this member"))
            await writer.drain()
            return
        self._active[node_id] += 1
        try:
            while True:
                try:
                    async with asyncio.timeout(self.config.idle_timeout_s):
                        prefix = await reader.readexactly(PREFIX_SIZE)
                except asyncio.IncompleteReadError:
                    return  # the client is done
                async with asyncio.timeout(self.config.reply_timeout_s):
                    request = parse_request(await reader.readexactly(header_length(prefix)))
                    await self._dispatch[type(request)](request, writer, node_id)
        finally:
            self._active[node_id] -= 1

    # ------------------------------------------------------------------ requests

    async def manifest(self, name: str) -> ModelManifest:
        """The manifest of stored model ``name``, hashed once and cached while its files stay."""
        try:
            path = model_path(self.home, name)
        except InvalidModelNameError as exc:
            raise _Refused("unknown_model", str(exc)) from None
        async with self._manifest_locks[name]:
            if not path.is_dir():
                raise _Refused("unknown_model", f"no model named {name!r} on this node")
            signature = await asyncio.to_thread(stat_signature, path)
            cached = self._manifests.get(name)
            if cached is None or cached[0] != signature:
                try:
                    built = await asyncio.to_thread(
                        build_manifest, path, name, self.config.chunk_size
                    )
                except ManifestError as exc:
                    raise _Refused("unknown_model", str(exc)) from None
                self._manifests[name] = (signature, built)
            return self._manifests[name][1]

    async def _serve_manifest(
        self, request: ManifestRequest, writer: asyncio.StreamWriter, node_id: str
    ) -> None:
        try:
            manifest = await self.manifest(request.name)
        except _Refused as exc:
            writer.write(refusal(exc.kind, str(exc)))
        else:
            body = manifest.model_dump_json().encode()
            writer.write(accept(len(body)) + body)
        await writer.drain()

    async def _serve_chunk(
        self, request: ChunkRequest, writer: asyncio.StreamWriter, node_id: str
    ) -> None:
        try:
            manifest = await self.manifest(request.name)
            entry = manifest.file(request.path)
        except _Refused as exc:
            writer.write(refusal(exc.kind, str(exc)))
            return await writer.drain()
        except ManifestError as exc:
            writer.write(refusal("unknown_file", str(exc)))
            return await writer.drain()
        if request.offset + request.length > entry.size:
            writer.write(refusal("bad_range", f"{request.path} has {entry.size} bytes"))
            return await writer.drain()
        path = model_path(self.home, request.name) / entry.path
        data = await asyncio.to_thread(_pread, path, request.offset, request.length)
        await self._throttle(node_id, len(data))
        writer.write(accept(len(data)))
        writer.write(data)
        await writer.drain()
        self.bytes_served += len(data)

    async def _throttle(self, node_id: str, n: int) -> None:
        rate = self.config.rate_bytes_per_s
        if not rate:
            return
        bucket = self._buckets.setdefault(node_id, TokenBucket(rate=rate, burst=rate))
        wait = bucket.delay(n, time.monotonic())
        if wait > 0:
            await asyncio.sleep(wait)


def _pread(path: Path, offset: int, length: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        data = os.pread(fd, length, offset)
    finally:
        os.close(fd)
    if len(data) != length:
        raise OSError(f"{path} is shorter than its manifest (changed while serving?)")
    return data
