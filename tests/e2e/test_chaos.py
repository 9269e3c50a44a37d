"""The UDP chaos proxy, against a plain UDP echo server (no QUIC): each fault does its job."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from lab.chaos import ChaosProxy


class _Echo(asyncio.DatagramProtocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        self.transport.sendto(data, addr)  # type: ignore[attr-defined]


class _Client(asyncio.DatagramProtocol):
    def __init__(self) -> None:
        self.received: asyncio.Queue[bytes] = asyncio.Queue()

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        self.received.put_nowait(data)


@pytest.fixture
async def proxied() -> AsyncIterator[tuple[ChaosProxy, asyncio.DatagramTransport, _Client]]:
    loop = asyncio.get_running_loop()
    echo_transport, _ = await loop.create_datagram_endpoint(_Echo, local_addr=("127.0.0.1", 0))
    proxy = ChaosProxy(("127.0.0.1", echo_transport.get_extra_info("sockname")[1]), seed=42)
    await proxy.start()
    client = _Client()
    transport, _ = await loop.create_datagram_endpoint(
        lambda: client, remote_addr=("127.0.0.1", proxy.port)
    )
    yield proxy, transport, client
    transport.close()
    await proxy.close()
    echo_transport.close()


async def send_paced(transport: asyncio.DatagramTransport, payloads: list[bytes]) -> None:
    """Send with a yield every few datagrams so no socket buffer overflows on its own."""
    for i, data in enumerate(payloads):
        transport.sendto(data)
        if i % 10 == 9:
            await asyncio.sleep(0.001)


async def drain(client: _Client, settle: float = 0.3) -> list[bytes]:
    """Everything that arrives until nothing more came for ``settle`` seconds."""
    out = []
    while True:
        try:
            out.append(await asyncio.wait_for(client.received.get(), settle))
        except TimeoutError:
            return out


async def test_clean_relay_round_trips_in_order(proxied) -> None:
    proxy, transport, client = proxied
    await send_paced(transport, [b"%d" % i for i in range(50)])
    assert await drain(client) == [b"%d" % i for i in range(50)]
    assert proxy.stats["upstream"].sent == 50 and proxy.stats["downstream"].sent == 50


async def test_loss_drops_about_the_fraction(proxied) -> None:
    proxy, transport, client = proxied
    proxy.set_faults("up", loss=0.3)
    await send_paced(transport, [b"%d" % i for i in range(400)])
    got = await drain(client)
    up = proxy.stats["upstream"]
    assert up.received == 400 and up.dropped + up.sent == 400
    assert 60 < up.dropped < 180  # seeded; 30 % of 400 = 120
    assert len(got) == up.sent


async def test_blackhole_is_silent_and_heals(proxied) -> None:
    proxy, transport, client = proxied
    proxy.set_faults(blackhole=True)
    transport.sendto(b"lost")
    assert await drain(client, 0.2) == []
    proxy.heal()
    transport.sendto(b"back")
    assert await drain(client) == [b"back"]


async def test_one_way_blackhole(proxied) -> None:
    proxy, transport, client = proxied
    proxy.downstream.blackhole = True
    transport.sendto(b"x")
    assert await drain(client, 0.2) == []
    assert proxy.stats["upstream"].sent == 1 and proxy.stats["downstream"].dropped == 1


async def test_duplication(proxied) -> None:
    proxy, transport, client = proxied
    proxy.set_faults("down", duplicate=1.0)
    transport.sendto(b"twice")
    assert await drain(client) == [b"twice", b"twice"]


async def test_jitter_reorders(proxied) -> None:
    proxy, transport, client = proxied
    proxy.set_faults("up", delay_ms=20, jitter_ms=20)
    sent = [b"%d" % i for i in range(60)]
    for data in sent:
        transport.sendto(data)
    got = await drain(client)
    assert sorted(got) == sorted(sent)
    assert got != sent  # seeded: some datagrams overtook others


async def test_bandwidth_cap_tail_drops_a_burst(proxied) -> None:
    proxy, transport, client = proxied
    proxy.set_faults("up", bandwidth=10_000, queue_ms=100)  # 10 kB/s, 100 ms of queue
    for _ in range(20):
        transport.sendto(b"x" * 500)  # 10 kB burst: only ~1 kB fits the queue
    got = await drain(client, 0.5)
    assert 1 <= len(got) < 20
    assert proxy.stats["upstream"].dropped == 20 - len(got)


def test_unknown_fault_is_refused() -> None:
    proxy = ChaosProxy(("127.0.0.1", 9))
    with pytest.raises(ValueError, match="unknown fault"):
        proxy.set_faults(los=0.1)
