"""What the QUIC tunnel adds: forwarding a streamed request to a peer, and raw tunnel streams.

1. Forwarding. Baseline: the scripted engine (``ScriptedUpstream``, one token per event, a loop
   yield between tokens) consumed directly in-process. Candidate: the same engine behind a
   peer – ``PeerUpstream`` → QUIC tunnel on loopback → ``TunnelServer`` → engine. Both
   endpoints live in this process, so "CPU per token" is the whole round trip's cost
   (requester + responder + aioquic both ways). Then streams per second with 1, 16 and 64
   streams in flight at once, over the same two paths; short streams (the per-stream cost);
   and engines paced like real ones (a token every 2 and 10 ms), where merging and
   coalescing have little or nothing to work with.
2. Raw streams. Baseline: the same frame codec over one asyncio TCP connection on loopback.
   Candidate: tunnel streams (one QUIC stream per request). Round trip of an empty request,
   and bulk DATA throughput on one stream.

Writes bench/results/tunnel.md.

    python bench/tunnel_overhead.py [--tokens 256] [--runs 20] [--rtt-runs 200] [--bulk-mb 16]
        [--concurrency 1 16 64] [--conc-streams 128] [--out FILE]
        [--before-results [LABEL=]FILE ...]

``--before-results [LABEL=]FILE ...``: files older commits' copies of this script wrote, run
back to back with this one on the same box; their tables are quoted under LABEL (the shared
box's load moves every absolute figure, so a before/after is only fair at the same load).
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gateway.events import Done, TextDelta, Usage  # noqa: E402
from gateway.request import ChatRequest, Message  # noqa: E402
from gateway.router import Router  # noqa: E402
from gateway.testing import ScriptedUpstream, Sleep  # noqa: E402
from gateway.upstream import ModelInfo, StaticDirectory  # noqa: E402
from mesh.identity import NodeIdentity  # noqa: E402
from mesh.peer_upstream import PeerUpstream  # noqa: E402
from mesh.tunnel.connection import PeerConnection  # noqa: E402
from mesh.tunnel.endpoint import TunnelEndpoint  # noqa: E402
from mesh.tunnel.frames import (  # noqa: E402
    BodyEnd,
    Data,
    End,
    FrameDecoder,
    RequestHead,
    ResponseHead,
    encode,
)
from mesh.tunnel.stream import TunnelStream  # noqa: E402
from mesh.tunnel_server import TunnelServer  # noqa: E402

CHUNK = 16 * 1024

TARGETS = {"cpu_us": 30.0, "sps16": 0.3, "ttft_ms": 2.0}


class AioquicMeter:
    """CPU seconds inside aioquic (datagrams in and out, timers) and datagrams sent, for the
    connections it is attached to: where the relay's time goes, measured in the run."""

    def __init__(self) -> None:
        self.cpu = 0.0
        self._conns: list = []
        self._start: dict[int, int] = {}

    def attach(self, conn: PeerConnection) -> None:
        quic = conn._quic
        for name in ("receive_datagram", "datagrams_to_send", "handle_timer"):
            setattr(quic, name, self._timed(getattr(quic, name)))
        self._conns.append(conn)

    def _timed(self, method: Callable) -> Callable:
        def timed(*args, **kwargs):
            start = time.process_time()
            try:
                return method(*args, **kwargs)
            finally:
                self.cpu += time.process_time() - start

        return timed

    def reset(self) -> None:
        self.cpu = 0.0
        self._start = {id(c): c._quic._packet_number for c in self._conns}

    def datagrams(self, conn: PeerConnection) -> int:
        return conn._quic._packet_number - self._start.get(id(conn), 0)


TOKEN = " tok"


class WakeMeter:
    """Times the event loop slept (a select that waited ≥ 0.1 ms for something to happen):
    each wake-up costs CPU of its own, and a paced stream's cost is mostly its wake-ups."""

    def __init__(self) -> None:
        self.sleeps = 0
        self._selector = asyncio.get_running_loop()._selector  # type: ignore[attr-defined]
        self._select = self._selector.select

    def __enter__(self) -> WakeMeter:
        def select(timeout=None):
            start = time.perf_counter()
            ready = self._select(timeout)
            if time.perf_counter() - start >= 1e-4:
                self.sleeps += 1
            return ready

        self._selector.select = select
        return self

    def __exit__(self, *exc: object) -> None:
        self._selector.select = self._select


def _engine(tokens: int, gap_s: float = 0.0) -> ScriptedUpstream:
    """``tokens`` tokens, ``gap_s`` apart (0: one per loop turn, a free-running engine)."""
    steps: list = []
    for _ in range(tokens):
        steps += [Sleep(gap_s), TextDelta(TOKEN)]
    return ScriptedUpstream.of(*steps, Usage(5, tokens), Done("stop"), name="bench")


def _pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else values[0]


async def _measure_stream(
    make_stream: Callable[[], object], runs: int
) -> tuple[list, float, int, int]:
    """TTFTs (s), CPU seconds, tokens and text events over ``runs`` streams. Tokens are
    counted in the text, not as events: the relay merges a free-running engine's deltas."""
    ttfts: list[float] = []
    chars = events = 0
    cpu0 = time.process_time()
    for _ in range(runs):
        start = time.perf_counter()
        first = True
        async for event in make_stream():  # type: ignore[attr-defined]
            if isinstance(event, TextDelta):
                if first:
                    ttfts.append(time.perf_counter() - start)
                    first = False
                chars += len(event.text)
                events += 1
    return ttfts, time.process_time() - cpu0, chars // len(TOKEN), events


async def _pair() -> tuple[TunnelEndpoint, TunnelEndpoint, PeerConnection]:
    a = TunnelEndpoint(NodeIdentity.generate(), "127.0.0.1", 0)
    b = TunnelEndpoint(NodeIdentity.generate(), "127.0.0.1", 0)
    await a.start()
    await b.start()
    conn = await a.connect("127.0.0.1", b.port, expected_node_id=b.identity.node_id)
    conn.mark_authenticated()  # the dialer's side too: the handshake is not run here
    return a, b, conn


def _serve_all(
    endpoint: TunnelEndpoint, handler: Callable[[TunnelStream], Awaitable[None]]
) -> None:
    async def on_connection(conn: PeerConnection) -> None:
        conn.on_stream = handler
        conn.mark_authenticated()

    endpoint.on_connection = on_connection


async def _streams_per_second(
    make_stream: Callable[[], object], concurrency: int, total: int
) -> tuple[float, int]:
    """``total`` streams (at least ``concurrency``), ``concurrency`` of them in flight at a
    time: (streams/s, failed)."""
    total = max(total, concurrency)
    pending = iter(range(total))
    failed = 0

    async def client() -> None:
        nonlocal failed
        for _ in pending:
            last = None
            async for event in make_stream():  # type: ignore[attr-defined]
                last = event
            if not isinstance(last, Done):  # an Error event, or a stream cut short
                failed += 1

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return total / (time.perf_counter() - start), failed


async def _throughput(make_stream, levels: list[int], total: int) -> dict[int, tuple]:
    return {c: await _streams_per_second(make_stream, c, total) for c in levels}


# Engines paced like real ones (a token every gap): (gap s, tokens per stream, streams).
PACED = [(0.002, 64, 3), (0.010, 32, 3)]
SHORT = 8  # tokens per stream of the short streams that tell a stream's fixed cost


def _paced_request(gap: float) -> ChatRequest:
    return ChatRequest(model=f"paced-{gap}", messages=[Message(role="user", content="x")])


async def bench_forwarding(tokens: int, runs: int, levels: list[int], total: int) -> dict:
    request = ChatRequest(model="m", messages=[Message(role="user", content="x")])
    engine = _engine(tokens)
    base = await _measure_stream(lambda: engine.stream(request), runs)
    base_sps = await _throughput(lambda: engine.stream(request), levels, total)
    # The serving side's own path without any tunnel: the engine behind its Router.
    alone = StaticDirectory()
    alone.add(ModelInfo(id="m"), engine)
    router, routes = Router(alone), alone.routes("m", None)
    router_sps = (await _streams_per_second(lambda: router.stream(request, routes), 16, total))[0]
    paced_base = {}
    for gap, n, streams in PACED:
        paced = _engine(n, gap)
        with WakeMeter() as wakes:
            measured = await _measure_stream(
                lambda paced=paced, gap=gap: paced.stream(_paced_request(gap)), streams
            )
        paced_base[gap] = (measured, wakes.sleeps)

    directory = StaticDirectory()
    directory.add(ModelInfo(id="m"), _engine(tokens))
    for gap, n, _ in PACED:
        directory.add(ModelInfo(id=f"paced-{gap}"), _engine(n, gap))
    directory.add(ModelInfo(id="short"), _engine(SHORT))
    short = ChatRequest(model="short", messages=[Message(role="user", content="x")])
    server = TunnelServer(directory)
    a = TunnelEndpoint(NodeIdentity.generate(), "127.0.0.1", 0)
    b = TunnelEndpoint(NodeIdentity.generate(), "127.0.0.1", 0)
    _serve_all(b, server.handle)
    _serve_all(a, server.handle)
    await a.start()
    await b.start()
    meter = AioquicMeter()
    try:
        conn = await a.connect("127.0.0.1", b.port, expected_node_id=b.identity.node_id)
        conn.mark_authenticated()  # the dialer's side too: the handshake is not run here
        served = b.connection_for(a.identity.node_id)
        assert served is not None
        meter.attach(conn)
        meter.attach(served)

        async def connect() -> PeerConnection:
            return conn

        peer = PeerUpstream(name=b.identity.node_id, connect=connect, self_id=a.identity.node_id)
        meter.reset()
        cand = await _measure_stream(lambda: peer.stream(request), runs)
        quic = {"cpu": meter.cpu, "down": meter.datagrams(served), "up": meter.datagrams(conn)}
        cand_sps = await _throughput(lambda: peer.stream(request), levels, total)
        # A fresh one, as the directory makes per request: its attempt counter starts at 0.
        peer = PeerUpstream(name=b.identity.node_id, connect=connect, self_id=a.identity.node_id)
        short_sps = (await _streams_per_second(lambda: peer.stream(short), 16, total))[0]
        paced_cand = {}
        for gap, _, streams in PACED:
            meter.reset()
            with WakeMeter() as wakes:
                measured = await _measure_stream(
                    lambda gap=gap: peer.stream(_paced_request(gap)), streams
                )
            dgrams = meter.datagrams(served) + meter.datagrams(conn)
            paced_cand[gap] = (measured, dgrams, wakes.sleeps)
    finally:
        await a.close()
        await b.close()
    return {
        "base": base,
        "cand": cand,
        "base_sps": base_sps,
        "cand_sps": cand_sps,
        "quic": quic,
        "paced_base": paced_base,
        "paced_cand": paced_cand,
        "short_sps": short_sps,
        "router_sps": router_sps,
    }


async def _tunnel_rtt(conn: PeerConnection, runs: int) -> list[float]:
    times = []
    for i in range(runs):
        start = time.perf_counter()
        stream = await conn.open_stream()
        await stream.send(RequestHead(id=str(i), path="/ping"))
        await stream.send(BodyEnd())
        async for _ in stream:
            pass
        times.append(time.perf_counter() - start)
    return times


async def _tunnel_bulk(conn: PeerConnection, total: int) -> tuple[float, float]:
    stream = await conn.open_stream()
    cpu0, start = time.process_time(), time.perf_counter()
    await stream.send(RequestHead(id="bulk", path="/bulk", headers={"n": str(total)}))
    await stream.send(BodyEnd())
    received = 0
    async for frame in stream:
        if isinstance(frame, Data):
            received += len(frame.data)
    assert received == total
    return time.perf_counter() - start, time.process_time() - cpu0


async def _answer(stream: TunnelStream) -> None:
    head = await stream.recv()
    assert isinstance(head, RequestHead)
    await stream.recv()
    await stream.send(ResponseHead(status=200))
    total = int(head.headers.get("n", "0"))
    for _ in range(total // CHUNK):
        await stream.send(Data(b"z" * CHUNK))
    await stream.send(End())


async def _tcp_server() -> tuple[asyncio.Server, int]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        decoder = FrameDecoder()
        while data := await reader.read(65536):
            for frame in decoder.feed(data):
                if isinstance(frame, RequestHead):
                    total = int(frame.headers.get("n", "0"))
                elif isinstance(frame, BodyEnd):
                    writer.write(encode(ResponseHead(status=200)))
                    for _ in range(total // CHUNK):
                        writer.write(encode(Data(b"z" * CHUNK)))
                        await writer.drain()
                    writer.write(encode(End()))
                    await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def _tcp_exchange(reader, writer, decoder: FrameDecoder, head: RequestHead) -> int:
    writer.write(encode(head) + encode(BodyEnd()))
    await writer.drain()
    received = 0
    while True:
        for frame in decoder.feed(await reader.read(65536)):
            if isinstance(frame, Data):
                received += len(frame.data)
            if isinstance(frame, End):
                return received


async def bench_raw(rtt_runs: int, bulk: int) -> dict:
    server, port = await _tcp_server()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    decoder = FrameDecoder()
    tcp_rtt = []
    for i in range(rtt_runs):
        start = time.perf_counter()
        await _tcp_exchange(reader, writer, decoder, RequestHead(id=str(i), path="/ping"))
        tcp_rtt.append(time.perf_counter() - start)
    cpu0, start = time.process_time(), time.perf_counter()
    head = RequestHead(id="bulk", path="/bulk", headers={"n": str(bulk)})
    assert await _tcp_exchange(reader, writer, decoder, head) == bulk
    tcp_bulk = (time.perf_counter() - start, time.process_time() - cpu0)
    writer.close()
    server.close()

    a, b, conn = None, None, None
    a = TunnelEndpoint(NodeIdentity.generate(), "127.0.0.1", 0)
    b = TunnelEndpoint(NodeIdentity.generate(), "127.0.0.1", 0)
    _serve_all(b, _answer)
    await a.start()
    await b.start()
    try:
        conn = await a.connect("127.0.0.1", b.port, expected_node_id=b.identity.node_id)
        conn.mark_authenticated()  # the dialer's side too: the handshake is not run here
        quic_rtt = await _tunnel_rtt(conn, rtt_runs)
        quic_bulk = await _tunnel_bulk(conn, bulk)
    finally:
        await a.close()
        await b.close()
    return {"tcp_rtt": tcp_rtt, "quic_rtt": quic_rtt, "tcp_bulk": tcp_bulk, "quic_bulk": quic_bulk}


def _loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f} ms"


def _verdict(met: bool) -> str:
    return "met" if met else "**missed**"


def report(args: argparse.Namespace, fwd: dict, raw: dict) -> str:
    (bt, bcpu, btok, _), (ct, ccpu, ctok, cevents) = fwd["base"], fwd["cand"]
    b_us, c_us = bcpu / btok * 1e6, ccpu / ctok * 1e6
    added50 = _pct(ct, 50) - _pct(bt, 50)
    quic = fwd["quic"]
    quic_us = quic["cpu"] / ctok * 1e6
    b16, c16 = fwd["base_sps"].get(16, (0, 0))[0], fwd["cand_sps"].get(16, (0, 0))[0]
    ratio16 = c16 / b16 if b16 else 0.0
    mb = args.bulk_mb
    lines = [
        "# Tunnel overhead",
        "",
        f"Python {platform.python_version()}, loopback, both tunnel ends in one process. "
        f"Forwarding: {args.tokens} tokens × {args.runs} streams from a free-running scripted "
        "engine (a token per loop turn). Paced: the same engine with a token every 2 or "
        f"10 ms, like a real one. Raw: {args.rtt_runs} sequential empty requests; {mb} MiB "
        f"bulk on one stream ({CHUNK // 1024} KiB DATA). Streams/s: {args.conc_streams} "
        f"streams of {args.tokens} tokens per level. Tokens are counted in the text received "
        "(the relay merges deltas). Ratios are against the direct path measured in the same "
        "run; before/after comparisons are the back-to-back runs quoted at the end.",
        "",
        "| forwarding | direct engine | via peer tunnel | added / ratio |",
        "|---|---|---|---|",
        f"| TTFT p50 | {_ms(_pct(bt, 50))} | {_ms(_pct(ct, 50))} | +{_ms(added50)} |",
        f"| TTFT p95 | {_ms(_pct(bt, 95))} | {_ms(_pct(ct, 95))} | "
        f"+{_ms(_pct(ct, 95) - _pct(bt, 95))} |",
        f"| CPU per token | {b_us:.1f} µs | {c_us:.1f} µs | {c_us / b_us:.2f}× |",
    ]
    for c, (b_sps, b_failed) in fwd["base_sps"].items():
        c_sps, c_failed = fwd["cand_sps"][c]
        failed = f" ({b_failed}/{c_failed} failed)" if b_failed or c_failed else ""
        lines.append(
            f"| streams/s, {c} in flight | {b_sps:.1f} | {c_sps:.1f} | "
            f"{c_sps / b_sps:.3f}×{failed} |"
        )
    lines.append(
        f"| streams/s, 16 in flight, {SHORT}-token streams | – | {fwd['short_sps']:.1f} | – |"
    )
    if b16:
        router16 = fwd["router_sps"]
        lines.append(
            f"| streams/s, 16 in flight, the engine behind the serving side's router, no "
            f"tunnel | {b16:.1f} | {router16:.1f} | {router16 / b16:.3f}× |"
        )
    paced_rows = []
    for gap, _n, _ in PACED:
        ((_, pb_cpu, pb_tok, _), b_wakes), ((_, pc_cpu, pc_tok, pc_ev), dgrams, c_wakes) = (
            fwd["paced_base"][gap],
            fwd["paced_cand"][gap],
        )
        pb_us, pc_us = pb_cpu / pb_tok * 1e6, pc_cpu / pc_tok * 1e6
        paced_rows.append(
            (gap, pc_us, dgrams / pc_tok, pc_ev / pc_tok, pb_us, b_wakes / pb_tok, c_wakes / pc_tok)
        )
        lines.append(
            f"| CPU per token, a token every {gap * 1000:.0f} ms | {pb_us:.1f} µs | "
            f"{pc_us:.1f} µs | {pc_us / pb_us:.2f}× |"
        )
    lines += [
        "",
        "| raw streams | TCP + same codec | QUIC tunnel stream | ratio |",
        "|---|---|---|---|",
    ]
    for q in (50, 95):
        tcp, quic_rtt = _pct(raw["tcp_rtt"], q), _pct(raw["quic_rtt"], q)
        lines.append(f"| request RTT p{q} | {_ms(tcp)} | {_ms(quic_rtt)} | {quic_rtt / tcp:.2f}× |")
    (tcp_wall, tcp_cpu), (quic_wall, quic_cpu) = raw["tcp_bulk"], raw["quic_bulk"]
    tcp_mbs, quic_mbs = mb / tcp_wall, mb / quic_wall
    lines.append(
        f"| bulk throughput (wall) | {tcp_mbs:.0f} MiB/s | {quic_mbs:.1f} MiB/s | "
        f"{quic_mbs / tcp_mbs:.3f}× |"
    )
    tcp_cpu_mbs, quic_cpu_mbs = mb / tcp_cpu, mb / quic_cpu
    lines.append(
        f"| bulk per CPU-second (both ends) | {tcp_cpu_mbs:.0f} MiB | {quic_cpu_mbs:.1f} MiB | "
        f"{quic_cpu_mbs / tcp_cpu_mbs:.3f}× |"
    )
    lines += [
        "",
        "| target (issue 14 §4) | measured | |",
        "|---|---|---|",
        f"| ≤ {TARGETS['cpu_us']:.0f} µs CPU per relayed token | {c_us:.1f} µs | "
        f"{_verdict(c_us <= TARGETS['cpu_us'])} |",
        f"| ≥ {TARGETS['sps16']}× direct streams/s at 16 in flight | {ratio16:.3f}× | "
        f"{_verdict(ratio16 >= TARGETS['sps16'])} |",
        f"| TTFT added ≤ {TARGETS['ttft_ms']:.0f} ms p50 | +{_ms(added50)} | "
        f"{_verdict(added50 * 1000 <= TARGETS['ttft_ms'])} |",
        "",
        *_explained(args, fwd, b_us, c_us, quic_us, ctok, cevents, paced_rows),
        "",
        f"Load average during the run: {_loadavg()} (shared machine: wall-clock numbers "
        "include waiting for a CPU, and CPU numbers grow with the load too). The tunnel "
        "carries requests and token streams, never bulk data; pure-Python QUIC (aioquic) "
        "costs per datagram.",
    ]
    return "\n".join(lines) + "\n"


def _explained(args, fwd, b_us, c_us, quic_us, ctok, cevents, paced_rows) -> list[str]:
    """Where the time goes and why a target is missed, in this run's own numbers."""
    quic = fwd["quic"]
    tokens = args.tokens
    b16, c16 = fwd["base_sps"].get(16, (0, 0))[0], fwd["cand_sps"].get(16, (0, 0))[0]
    lines = [
        f"Where a relayed token's {c_us:.1f} µs go (free engine, one stream at a time): "
        f"{quic_us:.1f} µs inside aioquic (both ends: datagrams built, encrypted, sent, "
        f"received, parsed, timers), {quic['down'] / ctok * 100:.1f} datagrams per 100 tokens "
        f"toward the requester and {quic['up'] / ctok * 100:.1f} back (the request, ACKs); "
        f"the deltas arrived as {cevents / ctok * 100:.1f} events per 100 tokens (those that "
        "wait for one flush leave as one). The rest is Python on both ends: per token the "
        "engine and its loop turn (as on the direct path, "
        f"{b_us:.1f} µs) and the serving side's router and pump; per stream the request, "
        "its head and End frames, the tasks that serve it.",
        "",
    ]
    for gap, us, dgrams, events, direct_us, direct_wakes, wakes in paced_rows:
        lines.append(
            f"- A token every {gap * 1000:.0f} ms: {us:.1f} µs per token, {dgrams:.2f} "
            f"datagrams per token (both ways), {events:.2f} events per token, the process "
            f"slept and woke {wakes:.2f} times per token (the direct path: {direct_wakes:.2f}, "
            f"{direct_us:.1f} µs per token: on this VM a process woken from sleep runs slowly "
            "at first, and the relay's work per token – its datagrams through aioquic, its "
            "event through both ends – runs cold after each wake-up, several times its "
            "free-running cost). "
            + (
                "Each token is a datagram of its own and its ACK 1 ms later: nothing to merge "
                "or coalesce."
                if gap >= 0.005
                else "Tokens that wait for the same 5 ms flush share a datagram and an event."
            )
        )
    slow_us = paced_rows[-1][1] if paced_rows else c_us
    lines += [
        f"- In absolute terms, at the slowest pace's per-token cost, a stream of 8 tokens/s "
        f"(this box's CPU decode) costs the relay {slow_us * 8 / 1e4:.1f}% of a core and one "
        f"of 100 tokens/s (a Mac's GPU) {slow_us * 100 / 1e4:.0f}%; free-running, a whole "
        f"core relays {1e6 / c_us if c_us else 0:,.0f} tokens/s.",
    ]
    if b16 and c16 and fwd["short_sps"]:
        w_long, w_short = 1 / c16, 1 / fwd["short_sps"]
        per_token = (w_long - w_short) / (tokens - SHORT)
        per_stream = w_short - SHORT * per_token
        budget = tokens / (b16 * tokens) / TARGETS["sps16"]  # wall time a stream may take
        lines += [
            f"- Streams/s at 16 in flight: the direct baseline is a free engine, {b16:.0f} "
            f"streams/s ({1e6 / (b16 * tokens):.1f} µs of wall time per token: the event "
            f"loop's ceiling). Via the peer a {tokens}-token stream takes {w_long * 1e3:.2f} "
            f"ms of the one core's time and a {SHORT}-token one {w_short * 1e3:.2f} ms: "
            f"{per_stream * 1e3:.2f} ms per stream (its request, its head and first token, "
            f"their ACKs, and the Python that serves it) plus {per_token * 1e6:.1f} µs per "
            f"token (against the direct {1e6 / (b16 * tokens):.1f} µs). {TARGETS['sps16']}× "
            f"the direct rate allows {budget * 1e3:.2f} ms per stream: the per-stream cost is "
            f"{per_stream / budget:.0%} of it and the tokens' "
            f"{per_token * tokens * 1e3:.2f} ms {per_token * tokens / budget:.0%}. The "
            f"serving side's router over the engine, with no tunnel at all, runs at "
            f"{fwd['router_sps'] / b16:.2f}× the direct rate.",
        ]
    lines += [
        "- TTFT: the added time is the request's own CPU before its first token (the request "
        "parsed and routed on the serving side, a datagram each way, both ends on one "
        "shared core); nothing on that path waits for coalescing (the request and the first "
        "token are never held).",
    ]
    return lines


def _quoted_before(label: str, before: str) -> str:
    """The tables and load line of an older run's results, under a heading of their own."""
    blocks = [b.strip() for b in before.split("\n\n")]
    kept = [b for b in blocks if b.startswith(("|", "Load average"))]
    return f"\n## Before: {label}, run back to back on the same box\n\n" + "\n\n".join(kept) + "\n"


async def main_async(args: argparse.Namespace) -> str:
    fwd = await bench_forwarding(args.tokens, args.runs, args.concurrency, args.conc_streams)
    raw = await bench_raw(args.rtt_runs, args.bulk_mb << 20)
    return report(args, fwd, raw)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--rtt-runs", type=int, default=200)
    parser.add_argument("--bulk-mb", type=int, default=16)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--conc-streams", type=int, default=128)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "tunnel.md")
    parser.add_argument("--before-results", nargs="+", default=[], metavar="[LABEL=]FILE")
    args = parser.parse_args()
    text = asyncio.run(main_async(args))
    for spec in args.before_results:
        label, _, path = spec.rpartition("=")
        text += _quoted_before(label or path, Path(path).read_text())
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
