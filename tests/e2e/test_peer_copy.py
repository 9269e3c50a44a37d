"""Peer copy over real TLS on loopback: copy servers and the client, in-process.

Two and three "nodes" (a home + identity + copy server each); the trust table is what a
MeshService would pass (members' certificates from their tunnel links)."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest

from mesh.copy.client import CopyOptions, CopySource, fetch_model
from mesh.copy.partial import partial_dir
from mesh.copy.server import CopyConfig, CopyServer
from mesh.copy.tls import cert_der
from mesh.errors import CopyRefused, DiskFull, ManifestError, PeerLost
from mesh.identity import NodeIdentity
from worker.store import list_models, model_path
from worker.testing import wait_until

CHUNK = 256 * 1024


class Peer:
    def __init__(self, home: Path, config: CopyConfig | None = None) -> None:
        self.home = home
        self.identity = NodeIdentity.load_or_create(home)
        self.members: dict[str, bytes] = {}
        self.server = CopyServer(
            home, self.identity, lambda: self.members, config or CopyConfig(chunk_size=CHUNK)
        )

    def trust(self, *others: Peer) -> None:
        for other in others:
            self.members[other.identity.node_id] = cert_der(other.identity)

    def source(self) -> CopySource:
        assert self.server.port is not None
        return CopySource(
            self.identity.node_id, "127.0.0.1", self.server.port, cert_der(self.identity)
        )


def make_multi_file_model(root: Path, shards: int = 3, shard_bytes: int = 700_000) -> Path:
    """config + tokenizer + ``shards`` weight files of pseudo-random bytes (no MLX needed)."""
    root.mkdir(parents=True)
    (root / "config.json").write_text('{"model_type": "llama"}')
    (root / "tokenizer.json").write_text('{"version": "1.0"}')
    for i in range(shards):
        (root / f"model-{i + 1:05d}-of-{shards:05d}.safetensors").write_bytes(
            os.urandom(shard_bytes + i)
        )
    return root


@pytest.fixture
async def peers(tmp_path):
    started: list[Peer] = []

    async def start(name: str, **config) -> Peer:
        peer = Peer(tmp_path / name, CopyConfig(chunk_size=CHUNK, **config))
        await peer.server.start()
        started.append(peer)
        return peer

    yield start
    for peer in started:
        await peer.server.close()


def _same_tree(a: Path, b: Path) -> bool:
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    other = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    return files == other and all((a / f).read_bytes() == (b / f).read_bytes() for f in files)


async def _fetch(peer: Peer, name: str, *sources: Peer, **kw) -> Path:
    return await fetch_model(peer.home, peer.identity, name, [s.source() for s in sources], **kw)


async def test_copy_the_tiny_model_between_two_nodes(peers, tiny_model_dir):
    a, b = await peers("a"), await peers("b")
    shutil.copytree(tiny_model_dir, model_path(a.home, "tiny"))
    a.trust(b)
    seen = []
    path = await _fetch(b, "tiny", a, on_progress=lambda p: seen.append(p.done_bytes))
    assert path == model_path(b.home, "tiny")
    assert _same_tree(model_path(a.home, "tiny"), path)
    assert [m.name for m in list_models(b.home)] == ["tiny"]
    assert not partial_dir(b.home, "tiny").exists()
    assert seen[-1] == sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


async def test_multi_file_model_from_three_nodes_in_parallel(peers, tmp_path):
    a, b, c = await peers("a"), await peers("b"), await peers("c")
    for src in (a, b):
        make_multi_file_model(model_path(src.home, "multi"))
        src.trust(c)
    shutil.rmtree(model_path(b.home, "multi"))
    shutil.copytree(model_path(a.home, "multi"), model_path(b.home, "multi"))
    progress = []
    path = await _fetch(c, "multi", a, b, on_progress=progress.append)
    assert _same_tree(model_path(a.home, "multi"), path)
    assert a.server.bytes_served > 0 and b.server.bytes_served > 0  # both carried chunks
    assert set(progress[-1].by_source) == {a.identity.node_id, b.identity.node_id}


async def test_a_subset_of_files_goes_to_its_own_directory(peers, tmp_path):
    a, b = await peers("a"), await peers("b")
    make_multi_file_model(model_path(a.home, "multi"))
    a.trust(b)
    wanted = ["config.json", "model-00002-of-00003.safetensors"]
    dest = tmp_path / "rank1"
    await _fetch(b, "multi", a, files=wanted, dest=dest)
    assert sorted(p.name for p in dest.iterdir()) == sorted(wanted)
    assert list_models(b.home) == []


async def test_a_non_member_is_refused(peers):
    a, stranger = await peers("a"), await peers("stranger")
    make_multi_file_model(model_path(a.home, "multi"))
    with pytest.raises(PeerLost, match="could be reached"):
        await _fetch(stranger, "multi", a)
    # The server counts the refusal on its own thread, after the client has seen it.
    await wait_until(lambda: a.server.refusals["not a member"] >= 1, limit_s=10)
    assert not model_path(stranger.home, "multi").exists()


async def test_unknown_model_is_one_sentence(peers):
    a, b = await peers("a"), await peers("b")
    a.trust(b)
    with pytest.raises(CopyRefused, match="no member holds a model named 'nope'"):
        await _fetch(b, "nope", a)
    assert list_models(b.home) == []


async def test_source_killed_mid_copy_resumes_from_another(peers):
    # a is slow (rate-limited) and dies part way; the copy finishes from c, resuming.
    a = await peers("a", rate_bytes_per_s=600_000)
    b = await peers("b")
    make_multi_file_model(model_path(a.home, "multi"))
    a.trust(b)
    task = asyncio.create_task(_fetch(b, "multi", a))
    await wait_until(lambda: a.server.bytes_served >= 600_000, limit_s=30)
    await a.server.close()
    with pytest.raises(PeerLost, match="went away mid-copy"):
        await task
    assert not model_path(b.home, "multi").exists()  # nothing half-copied in the store
    assert partial_dir(b.home, "multi").is_dir()
    c = await peers("c")
    shutil.copytree(model_path(a.home, "multi"), model_path(c.home, "multi"))
    c.trust(b)
    progress = []
    path = await _fetch(b, "multi", c, on_progress=progress.append)
    assert _same_tree(model_path(a.home, "multi"), path)
    total = progress[-1].total_bytes
    assert progress[-1].resumed_bytes >= 500_000
    assert c.server.bytes_served == total - progress[-1].resumed_bytes


async def test_a_source_that_dies_mid_copy_is_replaced_by_the_other(peers):
    a = await peers("a", rate_bytes_per_s=300_000)
    c = await peers("c", rate_bytes_per_s=300_000)
    b = await peers("b")
    make_multi_file_model(model_path(a.home, "multi"))
    shutil.copytree(model_path(a.home, "multi"), model_path(c.home, "multi"))
    a.trust(b)
    c.trust(b)
    task = asyncio.create_task(_fetch(b, "multi", a, c))
    await wait_until(lambda: a.server.bytes_served >= 300_000, limit_s=30)
    await a.server.close()
    path = await task
    assert _same_tree(model_path(c.home, "multi"), path)


class FlippingProxy:
    """TCP proxy client → server that flips one byte of the server's reply stream once
    ``after`` bytes have passed (TLS then fails its record MAC, so the connection dies)."""

    def __init__(self, target_port: int, after: int) -> None:
        self.target_port, self.after, self.flipped = target_port, after, False
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._on, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def _on(self, reader, writer) -> None:
        up_r, up_w = await asyncio.open_connection("127.0.0.1", self.target_port)

        async def pump(src, dst, flip: bool) -> None:
            passed = 0
            try:
                while data := await src.read(65536):
                    if flip and not self.flipped and passed + len(data) > self.after:
                        i = max(0, self.after - passed)
                        data = data[:i] + bytes([data[i] ^ 0x01]) + data[i + 1 :]
                        self.flipped = True
                    passed += len(data)
                    dst.write(data)
                    await dst.drain()
            except OSError:
                pass
            finally:
                dst.close()

        await asyncio.gather(pump(reader, up_w, False), pump(up_r, writer, True))

    async def close(self) -> None:
        assert self.server is not None
        self.server.close()


async def test_a_byte_flipped_on_the_wire_is_rejected_and_refetched(peers):
    a, b, c = await peers("a"), await peers("b"), await peers("c")
    make_multi_file_model(model_path(a.home, "multi"))
    shutil.copytree(model_path(a.home, "multi"), model_path(c.home, "multi"))
    a.trust(b)
    c.trust(b)
    proxy = FlippingProxy(a.server.port, after=50_000)
    port = await proxy.start()
    bad = CopySource(a.identity.node_id, "127.0.0.1", port, cert_der(a.identity))
    progress = []
    path = await fetch_model(
        b.home, b.identity, "multi", [bad, c.source()], on_progress=progress.append
    )
    await proxy.close()
    assert proxy.flipped
    assert _same_tree(model_path(a.home, "multi"), path)
    assert a.identity.node_id in progress[-1].dropped  # the corrupted path was dropped


async def test_a_member_sending_bad_chunk_bytes_is_dropped(peers, monkeypatch):
    """Bytes that pass TLS but not the chunk hash (a faulty or lying member)."""
    a, b, c = await peers("a"), await peers("b"), await peers("c")
    make_multi_file_model(model_path(a.home, "multi"))
    shutil.copytree(model_path(a.home, "multi"), model_path(c.home, "multi"))
    a.trust(b)
    c.trust(b)
    import mesh.copy.server as server_module

    real = server_module._pread

    def lying_pread(path, offset, into):
        data = real(path, offset, into)
        if a.home in Path(path).parents:
            data[0] ^= 0xFF
        return data

    monkeypatch.setattr(server_module, "_pread", lying_pread)
    progress = []
    path = await _fetch(b, "multi", a, c, on_progress=progress.append)
    assert _same_tree(model_path(c.home, "multi"), path)
    assert "bad bytes" in progress[-1].dropped[a.identity.node_id]


async def test_a_tampered_manifest_leaves_the_store_unchanged(peers, monkeypatch):
    a, b = await peers("a"), await peers("b")
    make_multi_file_model(model_path(a.home, "multi"))
    a.trust(b)
    real = a.server.manifest

    async def tampered(name):
        manifest = await real(name)
        first = manifest.files[0].model_copy(update={"sha256": "0" * 64})
        return manifest.model_copy(update={"files": [first, *manifest.files[1:]]})

    monkeypatch.setattr(a.server, "manifest", tampered)
    with pytest.raises(ManifestError, match="tampered manifest"):
        await _fetch(b, "multi", a)
    assert list_models(b.home) == [] and not partial_dir(b.home, "multi").exists()


async def test_a_tampered_chunk_hash_fails_every_source_and_stores_nothing(peers, monkeypatch):
    """A manifest whose file hashes add up but one chunk hash is wrong (a lying manifest that
    two sources agree on): no bytes verify as that chunk, so the copy ends, nothing stored."""
    a, b, c = await peers("a"), await peers("b"), await peers("c")
    make_multi_file_model(model_path(a.home, "multi"))
    shutil.copytree(model_path(a.home, "multi"), model_path(c.home, "multi"))
    a.trust(b)
    c.trust(b)

    def tamper(server):
        real = server.manifest

        async def tampered(name):
            manifest = await real(name)
            files = list(manifest.files)
            i = next(i for i, f in enumerate(files) if len(f.chunks) > 1)
            files[i] = files[i].model_copy(update={"chunks": [*files[i].chunks[:-1], "0" * 64]})
            return manifest.model_copy(update={"files": files})

        monkeypatch.setattr(server, "manifest", tampered)

    tamper(a.server)
    tamper(c.server)
    with pytest.raises(PeerLost, match="sent bad bytes"):
        await _fetch(b, "multi", a, c)
    assert list_models(b.home) == []


async def test_disk_full_is_one_sentence(peers, monkeypatch):
    a, b = await peers("a"), await peers("b")
    make_multi_file_model(model_path(a.home, "multi"))
    a.trust(b)

    def full(path):
        return shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000)  # type: ignore[attr-defined]

    monkeypatch.setattr(shutil, "disk_usage", full)
    with pytest.raises(DiskFull, match="not enough disk space for multi"):
        await _fetch(b, "multi", a)
    assert list_models(b.home) == []


async def test_enospc_while_writing_is_disk_full(peers, monkeypatch):
    a, b = await peers("a"), await peers("b")
    make_multi_file_model(model_path(a.home, "multi"))
    a.trust(b)

    def no_space(fd, data, offset):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "pwrite", no_space)
    with pytest.raises(DiskFull, match="disk filled up"):
        await _fetch(b, "multi", a, options=CopyOptions(connections_per_source=1))
    assert list_models(b.home) == []
