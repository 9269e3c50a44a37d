"""A UDP chaos proxy: sits between a QUIC client and server and injects network faults.

Clients send to the proxy's address; it relays to ``target`` through one upstream socket per
client (so replies find their way back). Each direction has its own ``Faults``, changeable
while running (tests and ``lab/netlab.py`` flip them mid-transfer):

* ``loss``       fraction of datagrams dropped (0.2 = 20 %)
* ``delay_ms`` ± ``jitter_ms``  one-way delay; jitter reorders datagrams
* ``duplicate``  fraction of datagrams sent twice
* ``blackhole``  drop everything silently (a partition; nothing tells the endpoints)
* ``bandwidth``  bytes per second (None = unlimited); excess beyond ``queue_ms`` is tail-dropped

The RNG is seedable so a failing run can be replayed::

    proxy = ChaosProxy(("127.0.0.1", server_port), seed=1)
    await proxy.start()                       # proxy.port: dial this instead of the server
    proxy.set_faults(loss=0.2)                # both directions
    proxy.downstream.blackhole = True         # server → client only
    await proxy.close()

Run standalone: ``python -m lab.chaos --target 10.0.0.2:9338 --listen 9400 --loss 0.1``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

Address = tuple[str, int]
log = logging.getLogger(__name__)


@dataclass
class Faults:
    """Faults for one direction; fields may be changed at any time."""

    loss: float = 0.0
    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    duplicate: float = 0.0
    blackhole: bool = False
    bandwidth: float | None = None  # bytes per second
    queue_ms: float = 200.0  # with a bandwidth cap: the most queueing delay before tail drop


@dataclass
class DirectionStats:
    received: int = 0
    sent: int = 0
    dropped: int = 0
    duplicated: int = 0


@dataclass
class _Lane:
    """One direction: its faults, counters and the bandwidth clock."""

    faults: Faults = field(default_factory=Faults)
    stats: DirectionStats = field(default_factory=DirectionStats)
    busy_until: float = 0.0


class _Relay(asyncio.DatagramProtocol):
    def __init__(
        self,
        on_datagram: Callable[[bytes, Address], None],
        on_open: Callable[[_Relay], None] | None = None,
    ) -> None:
        self.on_datagram = on_datagram
        self.on_open = on_open
        self.transport: asyncio.DatagramTransport | None = None
        self.waiting: list[bytes] = []  # client datagrams that arrived while the socket opened

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if self.on_open is not None:
            self.on_open(self)

    def datagram_received(self, data: bytes, addr: Address) -> None:
        self.on_datagram(data, addr)

    def error_received(self, exc: Exception) -> None:
        pass  # ICMP port unreachable etc.: a proxy relays, it does not care


class ChaosProxy:
    """UDP relay ``listen → target`` with per-direction faults (``upstream``/``downstream``)."""

    def __init__(
        self,
        target: Address,
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
        *,
        seed: int | None = None,
    ) -> None:
        self.target = target
        self.listen_host = listen_host
        self.port = listen_port
        self.rng = random.Random(seed)
        self._up = _Lane()
        self._down = _Lane()
        self._listener: _Relay | None = None
        self._sessions: dict[Address, _Relay] = {}
        self._timers: set[asyncio.TimerHandle] = set()
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def upstream(self) -> Faults:
        """Faults for client → target datagrams."""
        return self._up.faults

    @property
    def downstream(self) -> Faults:
        """Faults for target → client datagrams."""
        return self._down.faults

    @property
    def stats(self) -> dict[str, DirectionStats]:
        return {"upstream": self._up.stats, "downstream": self._down.stats}

    def set_faults(self, direction: str = "both", **changes: Any) -> None:
        """Change fault fields (``loss=0.2, blackhole=True, ...``) on "up", "down" or "both"."""
        known = {f.name for f in fields(Faults)}
        unknown = set(changes) - known
        if unknown:
            raise ValueError(f"unknown fault(s): {sorted(unknown)}")
        lanes = {"up": [self._up], "down": [self._down], "both": [self._up, self._down]}
        for lane in lanes[direction]:
            for name, value in changes.items():
                setattr(lane.faults, name, value)

    def heal(self) -> None:
        """Remove every fault in both directions."""
        self._up.faults = Faults()
        self._down.faults = Faults()

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        _, self._listener = await self._loop.create_datagram_endpoint(
            lambda: _Relay(self._from_client), local_addr=(self.listen_host, self.port)
        )
        assert self._listener.transport is not None
        self.port = self._listener.transport.get_extra_info("sockname")[1]

    async def close(self) -> None:
        for timer in self._timers:
            timer.cancel()
        self._timers.clear()
        for relay in self._sessions.values():
            if relay.transport is not None:
                relay.transport.close()
        self._sessions.clear()
        if self._listener is not None and self._listener.transport is not None:
            self._listener.transport.close()
        self._listener = None

    # ---- relaying ----

    def _from_client(self, data: bytes, client: Address) -> None:
        relay = self._sessions.get(client)
        if relay is None:
            relay = _Relay(lambda d, _addr: self._from_target(d, client), self._flush_waiting)
            self._sessions[client] = relay
            assert self._loop is not None
            task = self._loop.create_task(self._open_session(relay))
            task.add_done_callback(_log_failure)
        if relay.transport is None:
            relay.waiting.append(data)
        else:
            self._relay(self._up, data, self._sender_to_target(relay))

    def _sender_to_target(self, relay: _Relay) -> Callable[[bytes], None]:
        def send(data: bytes) -> None:
            if relay.transport is not None and not relay.transport.is_closing():
                relay.transport.sendto(data, self.target)

        return send

    async def _open_session(self, relay: _Relay) -> None:
        assert self._loop is not None
        family_any = "::" if ":" in self.target[0] else "0.0.0.0"
        await self._loop.create_datagram_endpoint(lambda: relay, local_addr=(family_any, 0))

    def _flush_waiting(self, relay: _Relay) -> None:
        if self._listener is None and relay.transport is not None:
            relay.transport.close()  # opened after close(): nothing left to relay for
            return
        waiting, relay.waiting = relay.waiting, []
        for data in waiting:
            self._relay(self._up, data, self._sender_to_target(relay))

    def _from_target(self, data: bytes, client: Address) -> None:
        listener = self._listener
        if listener is None or listener.transport is None:
            return
        transport = listener.transport

        def send(payload: bytes) -> None:
            if not transport.is_closing():
                transport.sendto(payload, client)

        self._relay(self._down, data, send)

    def _relay(self, lane: _Lane, data: bytes, send: Callable[[bytes], None]) -> None:
        faults, stats = lane.faults, lane.stats
        stats.received += 1
        if faults.blackhole or (faults.loss > 0 and self.rng.random() < faults.loss):
            stats.dropped += 1
            return
        copies = 2 if faults.duplicate > 0 and self.rng.random() < faults.duplicate else 1
        stats.duplicated += copies - 1
        assert self._loop is not None
        now = self._loop.time()
        depart = now
        if faults.bandwidth:
            start = max(now, lane.busy_until)
            if start - now > faults.queue_ms / 1000:
                stats.dropped += 1
                return
            lane.busy_until = start + len(data) / faults.bandwidth
            depart = lane.busy_until
        for _ in range(copies):
            delay = depart - now
            if faults.delay_ms or faults.jitter_ms:
                jitter = self.rng.uniform(-faults.jitter_ms, faults.jitter_ms)
                delay += max(0.0, faults.delay_ms + jitter) / 1000
            self._send_later(delay, data, send, stats)

    def _send_later(
        self, delay: float, data: bytes, send: Callable[[bytes], None], stats: DirectionStats
    ) -> None:
        def fire() -> None:
            self._timers.discard(handle)
            stats.sent += 1
            send(data)

        if delay <= 0:
            stats.sent += 1
            send(data)
            return
        assert self._loop is not None
        handle = self._loop.call_later(delay, fire)
        self._timers.add(handle)


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("chaos proxy: cannot open an upstream socket: %s", task.exception())


def _parse_address(text: str) -> Address:
    host, _, port = text.rpartition(":")
    return (host.strip("[]") or "127.0.0.1", int(port))


async def _run(args: argparse.Namespace) -> None:
    proxy = ChaosProxy(_parse_address(args.target), args.host, args.listen, seed=args.seed)
    proxy.set_faults(
        loss=args.loss,
        delay_ms=args.delay_ms,
        jitter_ms=args.jitter_ms,
        duplicate=args.duplicate,
        bandwidth=args.bandwidth,
    )
    await proxy.start()
    print(f"chaos proxy {args.host}:{proxy.port} -> {args.target}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await proxy.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="UDP chaos proxy for mesh tunnels")
    parser.add_argument("--target", required=True, help="host:port to relay to")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--listen", type=int, default=0)
    parser.add_argument("--loss", type=float, default=0.0)
    parser.add_argument("--delay-ms", type=float, default=0.0)
    parser.add_argument("--jitter-ms", type=float, default=0.0)
    parser.add_argument("--duplicate", type=float, default=0.0)
    parser.add_argument("--bandwidth", type=float, default=None, help="bytes per second")
    parser.add_argument("--seed", type=int, default=None)
    asyncio.run(_run(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
