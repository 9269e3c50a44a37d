"""The copy server: hands stored models to members over TLS 1.3, chunk by chunk.

asyncio accepts; each connection is then served by a thread over a blocking ``SSLSocket`` whose
context trusts only the certificates of the current members (rebuilt when they change), so a
stranger fails the handshake; the presented certificate is then mapped to a node id and checked
against the member table once more. Per connection: a handshake deadline, an idle deadline
between requests and a deadline per reply. Per member: a cap on concurrent connections and an
optional byte-rate limit (a token bucket).

Chunks go out block by block, each read into the connection's one small reused buffer and
``sendall``-ed from it while it is still in the CPU's cache:
``loop.sendfile`` cannot write through TLS (asyncio falls back to read+write itself), kTLS is
out of scope, and asyncio's SSL transport was slower than a blocking socket. A chunk request is
answered from the cached manifest while the file's size and mtime are unchanged, on the serving
thread (no hop through the event loop); ``bench/peer_copy.py`` measures the cost against raw TCP.

    server = CopyServer(home, identity, trusted=lambda: {node_id: cert_der, ...})
    await server.start()         # server.port
    await server.close()
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from mesh.copy.manifest import (
    CHUNK_SIZE,
    FileEntry,
    ModelManifest,
    build_manifest,
    stat_signature,
)
from mesh.copy.protocol import (
    IO_BLOCK,
    PREFIX_SIZE,
    ChunkRequest,
    ManifestRequest,
    ProtocolError,
    accept,
    header_length,
    parse_request,
    refusal,
)
from mesh.copy.tls import make_context, peer_node_id, recv_exactly
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
        self._loop: asyncio.AbstractEventLoop | None = None
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task[None]
        self._threads = ThreadPoolExecutor(
            max(4, self.config.max_connections_per_member * 4), thread_name_prefix="copy-serve"
        )
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._by_member: dict[str, set[ssl.SSLSocket]] = defaultdict(set)
        self._context: tuple[frozenset[bytes], ssl.SSLContext] | None = None
        self._manifests: dict[str, tuple[tuple, ModelManifest]] = {}
        self._manifest_locks: dict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._active: dict[str, int] = defaultdict(int)
        self._buckets: dict[str, TokenBucket] = {}
        self._handlers: set[asyncio.Future[None]] = set()
        self._dispatch: dict[type, Callable[..., None]] = {
            ManifestRequest: self._serve_manifest,
            ChunkRequest: self._serve_chunk,
        }

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        listener = socket.create_server((self.config.host, self.config.port), reuse_port=False)
        listener.setblocking(False)
        self._listener = listener
        self.port = listener.getsockname()[1]
        self._accepting = self._loop.create_task(self._accept_loop(listener))
        log.info("copy server on %s:%d (tls 1.3, members only)", self.config.host, self.port)

    async def close(self) -> None:
        if self._listener is None:
            return
        self._accepting.cancel()
        await asyncio.gather(self._accepting, return_exceptions=True)
        self._listener.close()
        self._listener = None
        for conn in list(self._open):
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)  # the serving thread's read fails at once
        await asyncio.gather(*self._handlers, return_exceptions=True)
        self._threads.shutdown(wait=False)

    def drop_member(self, node_id: str) -> int:
        """A member was removed: end its open connections now (a connection made before the
        removal must not keep serving). Returns how many were open."""
        with self._lock:
            open_now = list(self._by_member.pop(node_id, ()))
        for tls in open_now:
            with contextlib.suppress(OSError):
                tls.shutdown(socket.SHUT_RDWR)  # the serving thread's read or write fails now
        if open_now:
            log.warning("copy: closed %d connection(s) of removed %s", len(open_now), node_id[:12])
        return len(open_now)

    def _ssl_context(self, trusted: dict[str, bytes]) -> ssl.SSLContext:
        key = frozenset(trusted.values())
        with self._lock:
            if self._context is None or self._context[0] != key:
                self._context = (key, make_context(self.identity, key, server=True))
            return self._context[1]

    # ------------------------------------------------------------------ connections
    # Accepting is asyncio; each connection is then served by a thread over a blocking
    # SSLSocket: asyncio's SSL transport encrypts through a MemoryBIO and copies every record,
    # which capped one connection at ~115 MiB/s here; ``sendall`` from a thread does not.

    async def _accept_loop(self, listener: socket.socket) -> None:
        assert self._loop is not None
        while True:
            conn, peer = await self._loop.sock_accept(listener)
            task = self._loop.run_in_executor(self._threads, self._serve_socket, conn, peer)
            self._handlers.add(task)
            task.add_done_callback(self._handlers.discard)

    def _serve_socket(self, raw: socket.socket, peer: object) -> None:
        self._open.add(raw)
        try:
            raw.setblocking(True)
            raw.settimeout(self.config.handshake_timeout_s)
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._ssl_context(self.trusted()).wrap_socket(raw, server_side=True) as tls:
                self._open.add(tls)  # wrap_socket detached ``raw``: close() must reach this one
                try:
                    self._serve_connection(tls)
                finally:
                    self._open.discard(tls)
        except (AuthFailed, ssl.SSLError) as exc:
            self.refusals["not a member"] += 1
            log.warning("copy: refused %s: %s", peer, exc)
        except (OSError, TimeoutError, asyncio.IncompleteReadError, ProtocolError) as exc:
            log.info("copy: connection from %s ended: %s", peer, exc)
        finally:
            self._open.discard(raw)
            raw.close()

    def _serve_connection(self, tls: ssl.SSLSocket) -> None:
        node_id = peer_node_id(tls)
        if node_id not in self.trusted():  # removed since the context was built
            raise AuthFailed(f"{short_id(node_id)} is not a member")
        with self._lock:
            busy = self._active[node_id] >= self.config.max_connections_per_member
            if not busy:
                self._active[node_id] += 1
                self._by_member[node_id].add(tls)
        if busy:
            self.refusals["busy"] += 1
            tls.sendall(refusal("busy", "too many copy connections from this member"))
            return
        block = memoryview(bytearray(IO_BLOCK))  # every chunk this connection sends
        try:
            while True:
                tls.settimeout(self.config.idle_timeout_s)
                try:
                    prefix = recv_exactly(tls, PREFIX_SIZE)
                except asyncio.IncompleteReadError as exc:
                    if not exc.partial:
                        return  # the client is done
                    raise
                tls.settimeout(self.config.reply_timeout_s)
                request = parse_request(recv_exactly(tls, header_length(prefix)))
                if node_id not in self.trusted():  # removed while this connection was open
                    raise AuthFailed(f"{short_id(node_id)} is no longer a member")
                self._dispatch[type(request)](request, tls, node_id, block)
        finally:
            with self._lock:
                self._active[node_id] -= 1
                self._by_member.get(node_id, set()).discard(tls)

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

    def _manifest_from_thread(self, name: str) -> ModelManifest:
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(self.manifest(name), self._loop).result()

    def _file_entry(self, name: str, path: str) -> FileEntry:
        """``path``'s manifest entry: from the cache while that file's size and mtime hold
        (checked here on the serving thread), else through :meth:`manifest` on the loop."""
        cached = self._manifests.get(name)
        if cached is not None:
            signature, manifest = cached
            for rel, size, mtime_ns in signature:
                if rel != path:
                    continue
                try:
                    st = (model_path(self.home, name) / rel).stat()
                except OSError:
                    break
                if (st.st_size, st.st_mtime_ns) == (size, mtime_ns):
                    return manifest.file(path)
                break
        return self._manifest_from_thread(name).file(path)

    def _serve_manifest(
        self, request: ManifestRequest, tls: ssl.SSLSocket, node_id: str, block: memoryview
    ) -> None:
        try:
            manifest = self._manifest_from_thread(request.name)
        except _Refused as exc:
            tls.sendall(refusal(exc.kind, str(exc)))
        else:
            body = manifest.model_dump_json().encode()
            tls.sendall(accept(len(body)) + body)

    def _serve_chunk(
        self, request: ChunkRequest, tls: ssl.SSLSocket, node_id: str, block: memoryview
    ) -> None:
        try:
            entry = self._file_entry(request.name, request.path)
        except _Refused as exc:
            return tls.sendall(refusal(exc.kind, str(exc)))
        except ManifestError as exc:
            return tls.sendall(refusal("unknown_file", str(exc)))
        if request.offset + request.length > entry.size:
            return tls.sendall(refusal("bad_range", f"{request.path} has {entry.size} bytes"))
        path = model_path(self.home, request.name) / entry.path
        self._throttle(node_id, request.length)
        with _corked(tls):
            tls.sendall(accept(request.length))
            # A file cut short from here on ends the connection mid-reply: the client drops us.
            for start in range(0, request.length, IO_BLOCK):
                size = min(IO_BLOCK, request.length - start)
                tls.sendall(_pread(path, request.offset + start, block[:size]))
        with self._lock:
            self.bytes_served += request.length

    def _throttle(self, node_id: str, n: int) -> None:
        rate = self.config.rate_bytes_per_s
        if not rate:
            return
        with self._lock:
            bucket = self._buckets.setdefault(node_id, TokenBucket(rate=rate, burst=rate))
            wait = bucket.delay(n, time.monotonic())
        if wait > 0:
            time.sleep(wait)


@contextlib.contextmanager
def _corked(sock: socket.socket) -> Iterator[None]:
    """Hold back partial segments while a chunk goes out (Linux ``TCP_CORK``): TLS writes one
    16 KiB record per call, and with ``TCP_NODELAY`` each became a segment of its own."""
    cork = getattr(socket, "TCP_CORK", None)
    if cork is None:
        yield
        return
    sock.setsockopt(socket.IPPROTO_TCP, cork, 1)
    try:
        yield
    finally:
        sock.setsockopt(socket.IPPROTO_TCP, cork, 0)


def _pread(path: Path, offset: int, into: memoryview) -> memoryview:
    """Fill ``into`` with ``path``'s bytes from ``offset``; returns it."""
    with open(path, "rb", buffering=0) as fh:
        fh.seek(offset)
        got = 0
        while got < len(into):
            n = fh.readinto(into[got:])
            if not n:
                raise OSError(f"{path} is shorter than its manifest (changed while serving?)")
            got += n
    return into
