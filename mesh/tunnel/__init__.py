"""QUIC tunnels between nodes: one pinned, mutually authenticated connection per peer pair.

The asyncio/aioquic adapter around the sans-IO frame codec (``frames.py``). Modules:
``config.py`` (``TunnelConfig``, ALPN, default port), ``endpoint.py`` (``TunnelEndpoint``),
``connection.py`` (``PeerConnection``), ``protocol.py`` (its aioquic protocol),
``neighbours.py`` (what a connection needs of the endpoint and of its aioquic protocol),
``stream.py`` (``TunnelStream``), ``pins.py`` (certificate pinning, node-id checks),
``registry.py`` (pure dial tie-break), ``keepalive.py`` (sans-IO pings and liveness),
``coalesce.py`` (the flush outbox), ``testing.py`` (in-memory stream pairs for tests).
Redialing lost peers is ``mesh/dialer.py``'s job.

API for the integrator::

    endpoint = TunnelEndpoint(identity, "0.0.0.0", 9338, config=TunnelConfig())
    endpoint.on_connection = on_conn          # async def on_conn(conn: PeerConnection)
    await endpoint.start()                    # endpoint.port is the bound UDP port
    conn = await endpoint.connect(host, port, expected_fingerprint=fp)   # or expected_node_id=
    ...
    await endpoint.close()

    # on every new connection (incoming AND outgoing, ``conn.is_client`` tells which):
    conn.on_stream = serve                    # async def serve(stream: TunnelStream)
    await conn.control.send(Control(kind="auth", body={...}))   # control stream, both ways
    msg = await conn.control.recv()
    conn.mark_authenticated()                 # peer streams are served only after this
    conn.close(ErrorCode.AUTH_FAILED, "bad secret")

    # a request (either side may open streams):
    stream = await conn.open_stream()
    async with stream:                        # leaving early resets the stream with CANCELLED
        await stream.send(RequestHead(id=..., path="/v1/chat/completions", deadline=30.0))
        await stream.send(Body(payload)); await stream.send(BodyEnd())
        async for frame in stream:            # ResponseHead, Data*, End; then iteration stops
            ...                               # EOF without End raises IncompleteResponse

    # serving one (on_stream handler):
    head = await stream.recv()                # RequestHead, Body*, BodyEnd
    await stream.send(ResponseHead(status=200)); await stream.send(Data(b"..."))
    await stream.send(Data(b"..."), defer=True)   # a later token: may share a datagram
    stream.before_flush(write_gathered)       # called right before that datagram is built,
    stream.send_held(Data(b"..."))            #   which writes what it gathered (no waiting)
    await stream.send(End())                  # or End(code=ErrorCode.REJECTED, message=...)
    error = await stream.wait_broken()        # race against long work: the requester left
    # a handler that returns without sending End gets its stream reset with INTERNAL

Frames bigger than 1 MiB do not exist: send a large body as several ``Body`` frames.

Security: TLS 1.3 with each node's Ed25519 certificate (aioquic signs with ed25519 as is; no
ECDSA fallback needed), ALPN ``mlx-mesh/1``, no 0-RTT, 1200-byte datagrams. The dialer pins the
server's certificate fingerprint or node id. The server requests the client's certificate
(mutual TLS, through a private aioquic flag – see ``pins.py``); TLS proves the client
holds the key, so ``conn.peer_node_id`` / ``peer_public_key`` are known on both sides. Whether
a peer is a MEMBER is decided above this layer (membership handshake on the control stream);
until ``mark_authenticated()`` the peer's request streams are held (up to
``max_held_streams``, beyond that reset with REJECTED), never served.

Behaviour:

* A peer with our own node id (copied home dir) is refused with DUPLICATE_NODE and a
  ``DuplicateNodeError`` (raised by ``connect``; logged and passed to ``on_duplicate_node``
  on the accepting side).
* Simultaneous dials collapse to one connection: the one initiated by the lower node id wins
  on both sides, the other is closed with SUPERSEDED (``connect`` returns the winner). The
  lower id holds the higher id's dial until its own dial to that peer ends: refused if ours
  succeeded, accepted if ours failed (a restarted peer that we dial at its old, dead address
  gets in when our dial gives up, and our ``connect`` returns its connection).
  Concurrent ``connect`` calls to one peer share one dial. A fresh connection from a peer
  replaces an old one that went silent (the peer restarted), so a restarted node is
  reachable at once, not only after the keep-alive noticed.
* Keep-alive: a ping every ``ping_interval`` s (aioquic has none); a peer silent for
  ``ping_timeout`` s (no datagram at all) gets the connection closed with PING_TIMEOUT and
  every stream's reader/sender gets ``ConnectionLost``. ``conn.rtt`` comes from the pings.
* Peer resets reach readers as ``StreamReset(code)``; EOF without the terminal frame raises
  ``IncompleteResponse``. Each stream direction is flow-controlled by the reader's
  consumption (see ``stream.py``). Finished streams leave no state behind.
* Frames out of order reset their stream with PROTOCOL; a failed control stream closes the
  connection with PROTOCOL.
* Coalescing: a frame sent with ``defer=True`` may wait up to ``flush_delay`` (5 ms) to share
  datagrams with the frames after it; any other frame is sent at once and takes them along
  (see ``protocol.py``); a deferred ``End`` waits only on a busy connection. A sender that
  gathers pieces (the tunnel server merging a response's tokens) writes them from a
  ``before_flush`` callback. Readers take what arrived with ``recv_batch()``, one wake-up per
  datagram rather than per frame.

Large transfers (model weights) never go through the tunnel: it carries requests, token
streams and control messages only.
"""
