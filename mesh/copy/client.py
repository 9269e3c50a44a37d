"""The copy client: fetch a model (or some of its files) from members, verified chunk by chunk.

:func:`fetch_model` asks every source for the manifest, keeps the sources that agree on it,
then runs a few connections per source that take chunks from one shared queue, so faster peers
carry more. Every chunk is hashed on arrival and written with ``pwrite`` into
``<home>/models/.partial/<name>/files/``; a source that sends bad bytes is dropped and its chunk
goes back to the queue for the others. A copy that stops (peer gone, disk full, Ctrl-C) leaves
the partial directory; the next fetch of the same manifest re-hashes what is there and fetches
only what is missing. When every chunk of every file is in and verified, the files are synced
and the directory is renamed into ``<home>/models/<name>`` in one step: the store never holds
half a model, and ``.partial`` is never listed or loaded. That on-disk side (resume, verified
writes, seal, install) is ``partial.py``; this module is the transport and the chunk queue.

A file is exactly the concatenation of its chunks (``iter_chunks`` covers every byte once), so
when each chunk hashed right the file is the bytes the manifest names: the whole file is not
hashed a second time (that pass cost as much CPU as the chunk hashes; ``bench/peer_copy.py``).
Each connection streams a chunk through one small reused buffer on its own thread: a block is
decrypted into it, hashed and written to the partial file while it is still in the CPU's cache,
and the chunk counts as verified only when its whole SHA-256 matched. A chunk that fails leaves
bad bytes in the *partial* file only; it goes back to the queue and its next fetch overwrites
them (a resume re-hashes what is on disk), and nothing reaches the store unless every chunk
verified.

Errors are :class:`~mesh.errors.CopyError` subclasses with one sentence each: ``PeerLost``
(nobody left to copy from), ``CopyRefused`` (e.g. no source holds the model), ``ManifestError``
(a manifest that is unsafe or not self-consistent), ``DiskFull``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import socket
import ssl
import threading
from collections import Counter, deque
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from mesh.copy import partial
from mesh.copy.manifest import (
    Chunk,
    ModelManifest,
    manifest_from_json,
    verify_digest,
)
from mesh.copy.progress import CopyProgress, ProgressSink
from mesh.copy.protocol import (
    IO_BLOCK,
    PREFIX_SIZE,
    ChunkRequest,
    ManifestRequest,
    ProtocolError,
    header_length,
    pack,
    parse_reply,
)
from mesh.copy.tls import make_context, peer_node_id, recv_exactly, recv_into_exactly
from mesh.errors import (
    AuthFailed,
    ChunkMismatch,
    CopyError,
    CopyRefused,
    DiskFull,
    ManifestError,
    PeerLost,
)
from mesh.identity import NodeIdentity, short_id
from worker.store import model_path

log = logging.getLogger(__name__)

_MiB = 1024 * 1024
_T = TypeVar("_T")


@dataclass(frozen=True)
class CopySource:
    """A member to copy from: where its copy server listens and the certificate it must show."""

    node_id: str
    host: str
    port: int
    cert_der: bytes


# ---------------------------------------------------------------------------- one connection


class _Connection:
    """One TLS connection to one source; requests one at a time.

    A blocking ``SSLSocket`` driven from a worker thread, not an asyncio stream: asyncio's SSL
    transport decrypts through a MemoryBIO and copies every record into the stream buffer
    (measured here: ~115 MiB/s), while ``SSLSocket.recv_into`` decrypts straight into the chunk
    buffer with the GIL released (~330 MiB/s on the same machine)."""

    def __init__(self, source: CopySource, timeout_s: float, threads: ThreadPoolExecutor) -> None:
        self.source = source
        self.timeout_s = timeout_s
        self._threads = threads  # one thread per connection: blocking reads never starve others
        self._sock: ssl.SSLSocket | None = None
        self._block = memoryview(bytearray(IO_BLOCK))  # every chunk streams through it

    async def open(self, identity: NodeIdentity) -> None:
        ctx = _client_context(identity, self.source.cert_der)
        loop = asyncio.get_running_loop()
        self._sock = await loop.run_in_executor(self._threads, self._connect, ctx)
        if peer_node_id(self._sock) != self.source.node_id:
            raise AuthFailed(f"the copy server is not {short_id(self.source.node_id)}")

    def _connect(self, ctx: ssl.SSLContext) -> ssl.SSLSocket:
        raw = socket.create_connection((self.source.host, self.source.port), self.timeout_s)
        try:
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return ctx.wrap_socket(raw)
        except BaseException:
            raw.close()
            raise

    async def request(self, message: ManifestRequest) -> bytes:
        return await self._in_thread(self._request, pack(message))

    async def fetch_chunk(
        self, request: ChunkRequest, chunk: Chunk, out: partial.PartialFiles
    ) -> None:
        """Fetch ``chunk`` into its partial file, hashing it as it streams, all on this
        connection's thread; ``ChunkMismatch`` if the bytes are not the chunk's."""
        await self._in_thread(self._fetch_chunk, pack(request), chunk, out)

    async def _in_thread(self, fn: Callable[..., _T], *args: object) -> _T:
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._threads, fn, *args)
        except asyncio.CancelledError:
            self._abort()  # the thread's blocking read fails at once
            raise

    def _reply(self, frame: bytes) -> int:
        """Send a request; the length of the body that follows the server's yes."""
        sock = self._sock
        assert sock is not None
        sock.sendall(frame)
        prefix = recv_exactly(sock, PREFIX_SIZE)
        reply = parse_reply(recv_exactly(sock, header_length(prefix)))
        if not reply.ok:
            raise CopyRefused(reply.message or reply.kind, reply.kind)
        return reply.length

    def _request(self, frame: bytes) -> bytes:
        length = self._reply(frame)
        assert self._sock is not None
        return recv_exactly(self._sock, length)

    def _fetch_chunk(self, frame: bytes, chunk: Chunk, out: partial.PartialFiles) -> None:
        length = self._reply(frame)
        if length != chunk.length:
            raise ChunkMismatch(
                f"{chunk.path} chunk {chunk.index}: offered {length} bytes, expected {chunk.length}"
            )
        assert self._sock is not None
        digest = hashlib.sha256()
        fd = out.open(chunk)
        try:
            for start in range(0, length, IO_BLOCK):
                piece = self._block[: min(IO_BLOCK, length - start)]
                recv_into_exactly(self._sock, piece)
                digest.update(piece)
                out.write(fd, piece, chunk.offset + start)
            verify_digest(chunk, length, digest.hexdigest())
            out.written(chunk, fd)
        finally:
            os.close(fd)

    def _abort(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)

    async def close(self) -> None:
        if self._sock is not None:
            self._abort()
            self._sock.close()
            self._sock = None


_CONTEXTS: dict[tuple[str, bytes], ssl.SSLContext] = {}
_CONTEXTS_LOCK = threading.Lock()


def _client_context(identity: NodeIdentity, server_cert: bytes) -> ssl.SSLContext:
    """One context per (our identity, pinned server certificate), shared by every connection to
    that server: building one (key through a temp file, trust store) costs ~2.5 ms of CPU, as
    much as copying a few MiB."""
    key = (identity.node_id, server_cert)
    with _CONTEXTS_LOCK:
        ctx = _CONTEXTS.get(key)
        if ctx is None:
            if len(_CONTEXTS) >= 64:  # members come and go; never grow without bound
                _CONTEXTS.clear()
            ctx = _CONTEXTS[key] = make_context(identity, [server_cert], server=False)
        return ctx


# Everything a source can do wrong on the wire, as the copy sees it: drop the source.
_SOURCE_FAILURES = (
    OSError,
    TimeoutError,
    ssl.SSLError,
    asyncio.IncompleteReadError,
    ProtocolError,
    AuthFailed,
    CopyRefused,
    ChunkMismatch,
)


def _why(exc: BaseException) -> str:
    if isinstance(exc, asyncio.IncompleteReadError):
        return "closed the connection mid-reply"
    if isinstance(exc, TimeoutError):
        return "timed out"
    if isinstance(exc, ChunkMismatch):
        return f"sent bad bytes ({exc})"
    return str(exc) or type(exc).__name__


# ---------------------------------------------------------------------------- the copy


@dataclass
class CopyOptions:
    connections_per_source: int = 3
    timeout_s: float = 60.0


class _Copy:
    """One fetch in progress: the chunk queue, the sources still trusted, the partial files."""

    def __init__(
        self,
        home: Path,
        identity: NodeIdentity,
        manifest: ModelManifest,
        sources: list[CopySource],
        progress: CopyProgress,
        sink: ProgressSink,
        options: CopyOptions,
    ) -> None:
        self.home, self.identity, self.manifest = home, identity, manifest
        self.sources, self.progress, self.sink, self.options = sources, progress, sink, options
        self.root = partial.partial_dir(home, manifest.name) / "files"
        self.pending: deque[Chunk] = deque()
        self.in_flight = 0
        self.changed = asyncio.Condition()
        self.fatal: CopyError | None = None
        self.verified: set[tuple[str, int]] = set()  # (path, chunk index) hashed right
        self.files = partial.PartialFiles(self.root, progress)
        self.threads = ThreadPoolExecutor(
            len(sources) * options.connections_per_source, thread_name_prefix="copy"
        )

    def prepare(self) -> None:
        """Create/size the partial files and queue every chunk not already there and valid."""
        pending, verified = partial.prepare(self.home, self.manifest, self.files)
        self.pending.extend(pending)
        self.verified.update(verified)

    # -- workers

    async def run(self) -> None:
        workers = [
            asyncio.create_task(self._worker(source))
            for source in self.sources
            for _ in range(self.options.connections_per_source)
        ]
        try:
            await asyncio.gather(*workers)
        finally:
            for task in workers:
                task.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            self.files.close()  # threads still reading an aborted socket write nothing more
            self.threads.shutdown(wait=False)
        if self.fatal is not None:
            raise self.fatal
        if self.pending:
            raise PeerLost(self._lost_message())

    def _lost_message(self) -> str:
        done, total = self.progress.done_bytes / _MiB, self.progress.total_bytes / _MiB
        why = "; ".join(f"{short_id(n)} {r}" for n, r in self.progress.dropped.items())
        return (
            f"every peer holding {self.manifest.name} went away mid-copy ({done:.0f} of "
            f"{total:.0f} MiB kept; pull again to resume){': ' + why if why else ''}"
        )

    async def _next(self, source: CopySource) -> Chunk | None:
        async with self.changed:
            while True:
                if self.fatal is not None or source.node_id in self.progress.dropped:
                    return None
                if self.pending:
                    self.in_flight += 1
                    return self.pending.popleft()
                if self.in_flight == 0:
                    return None
                await self.changed.wait()

    async def _finish(self, chunk: Chunk | None, failed: bool) -> None:
        async with self.changed:
            if chunk is not None:
                self.in_flight -= 1
                if failed:
                    self.pending.appendleft(chunk)
            self.changed.notify_all()

    def _drop(self, source: CopySource, exc: BaseException) -> None:
        if source.node_id not in self.progress.dropped:
            reason = _why(exc)
            log.warning("copy: dropping %s: %s", short_id(source.node_id), reason)
            self.progress.dropped[source.node_id] = reason
            self.sink(self.progress)

    async def _worker(self, source: CopySource) -> None:
        conn = _Connection(source, self.options.timeout_s, self.threads)
        chunk: Chunk | None = None
        try:
            await conn.open(self.identity)
            while (chunk := await self._next(source)) is not None:
                request = ChunkRequest(
                    name=self.manifest.name,
                    path=chunk.path,
                    offset=chunk.offset,
                    length=chunk.length,
                )
                await conn.fetch_chunk(request, chunk, self.files)
                self.verified.add((chunk.path, chunk.index))
                self._count(source, chunk)
                await self._finish(chunk, failed=False)
                chunk = None
        except _SOURCE_FAILURES as exc:
            self._drop(source, exc)
            await self._finish(chunk, failed=True)
        except DiskFull as exc:
            self.fatal = exc
            await self._finish(chunk, failed=True)
        finally:
            await conn.close()

    def _count(self, source: CopySource, chunk: Chunk) -> None:
        p = self.progress
        p.done_bytes += chunk.length
        p.by_source[source.node_id] = p.by_source.get(source.node_id, 0) + chunk.length
        self.sink(p)

    def seal(self) -> None:
        """Every chunk verified and every file on disk (``partial.seal``)."""
        partial.seal(self.manifest, self.files, self.verified)


# ---------------------------------------------------------------------------- entry points


async def fetch_manifest(
    identity: NodeIdentity, sources: Iterable[CopySource], name: str, timeout_s: float = 30.0
) -> tuple[ModelManifest, list[CopySource], dict[str, str]]:
    """Ask every source for NAME's manifest: (the manifest most of them agree on, those
    sources, node id → why each other source was left out). ``CopyError`` when none has it."""

    async def ask(source: CopySource) -> ModelManifest:
        conn = _Connection(source, timeout_s, threads)
        try:
            await conn.open(identity)
            return manifest_from_json(await conn.request(ManifestRequest(name=name)), name)
        finally:
            await conn.close()

    sources = list(sources)
    if not sources:
        raise PeerLost(f"no member holds {name}")
    threads = ThreadPoolExecutor(len(sources), thread_name_prefix="copy-manifest")
    try:
        answers = await asyncio.gather(*(ask(s) for s in sources), return_exceptions=True)
    finally:
        threads.shutdown(wait=False)
    left_out: dict[str, str] = {}
    good: list[tuple[CopySource, ModelManifest]] = []
    errors: list[BaseException] = []
    for source, answer in zip(sources, answers, strict=True):
        if isinstance(answer, ModelManifest):
            good.append((source, answer))
        elif isinstance(answer, (*_SOURCE_FAILURES, ManifestError)):
            left_out[source.node_id] = _why(answer)
            errors.append(answer)
        else:
            raise answer
    if not good:
        raise _no_manifest(name, errors, left_out)
    votes = Counter(m.digest() for _, m in good)
    winner = votes.most_common(1)[0][0]
    chosen = [s for s, m in good if m.digest() == winner]
    for source, manifest in good:
        if manifest.digest() != winner:
            left_out[source.node_id] = "holds different bytes under that name"
    return next(m for _, m in good if m.digest() == winner), chosen, left_out


def _no_manifest(name: str, errors: list[BaseException], left_out: dict[str, str]) -> CopyError:
    if errors and all(isinstance(e, CopyRefused) and e.kind == "unknown_model" for e in errors):
        return CopyRefused(f"no member holds a model named {name!r}", "unknown_model")
    manifest_errors = [e for e in errors if isinstance(e, ManifestError)]
    if manifest_errors:
        return ManifestError(
            f"the manifest of {name} from the peers is unusable: {manifest_errors[0]}"
        )
    why = "; ".join(f"{short_id(n)} {r}" for n, r in left_out.items())
    return PeerLost(f"no peer holding {name} could be reached: {why}")


async def fetch_model(
    home: Path,
    identity: NodeIdentity,
    name: str,
    sources: Iterable[CopySource],
    *,
    files: Iterable[str] | None = None,
    dest: Path | None = None,
    on_progress: ProgressSink | None = None,
    options: CopyOptions | None = None,
) -> Path:
    """Copy NAME (all files, or only ``files`` into ``dest``) from ``sources`` into the store.

    Returns the model's directory. Raises a :class:`CopyError`; the store is then unchanged
    (an interrupted copy waits in ``.partial`` to be resumed)."""
    target = dest if dest is not None else model_path(home, name)
    if files is not None and dest is None:
        raise CopyError("copying only some files needs a destination outside the store (dest)")
    if target.is_dir():
        return target
    manifest, chosen, left_out = await fetch_manifest(identity, sources, name)
    manifest = manifest.subset(files)
    progress = CopyProgress(name=name, total_bytes=manifest.total_bytes)
    progress.dropped.update(left_out)
    copy = _Copy(
        home, identity, manifest, chosen, progress, on_progress or _ignore, options or CopyOptions()
    )
    await asyncio.to_thread(partial.reset_if_stale, home, manifest)
    await asyncio.to_thread(copy.prepare)
    copy.sink(progress)
    await copy.run()
    await asyncio.to_thread(copy.seal)
    return await asyncio.to_thread(partial.install, home, manifest, target)


def _ignore(progress: CopyProgress) -> None:
    pass
