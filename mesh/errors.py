"""The root of mesh's exceptions. Every error mesh raises on purpose is a ``MeshError``, and every
one is drawn here (``tests/unit/mesh/test_errors.py`` checks); those defined beside the one
format they guard name their module::

    MeshError
    ├── NodeError                the node cannot start: bad configuration, a worker never came up
    ├── AddressError             not ``HOST:PORT``
    ├── InviteError              an invite token or TTL that is malformed, foreign or expired
    ├── MembershipError          this node cannot be (or become) a member: join refused, ...
    ├── HandshakeInputError      the peer sent something that is not a membership message
    ├── GossipDecodeError        gossip bytes that are not a gossip message
    │   └── UnknownGossipType    a gossip type this version does not know (a newer peer's)
    ├── IdentityError            unreadable/mismatched key or certificate in the home dir
    ├── FrameError               the frame codec got bytes it cannot decode (or a frame too large)
    │   └── ProtocolViolation    well-formed frames in an order the protocol forbids
    ├── CopyError                copying a model from peers (``mesh.copy``): one sentence each
    │   ├── ManifestError        a manifest that is malformed, unsafe or not self-consistent
    │   ├── ChunkMismatch        bytes that do not hash to the manifest's chunk (the peer is dropped)
    │   ├── CopyRefused          the peer said no: unknown model, not a member, too busy
    │   ├── PeerLost             no peer holding the model is left (gone mid-copy, or none at all)
    │   ├── DiskFull             not enough space in the store for the copy
    │   └── ProtocolError        bytes on the copy channel that are not a copy message
    │                            (``copy/protocol.py``)
    ├── SplitError               serving one model across several nodes (``mesh.split``)
    │   ├── PlanError            no set of members can hold the model (one sentence)
    │   ├── BadOrder             a rank order or report that does not parse (``split/orders.py``)
    │   └── OfferExhausted       the order is fine, but this node's offer has no room for it
    │                            now (``split/host.py``; HTTP 409, not 400)
    └── TunnelError              anything on the QUIC tunnel
        ├── ConnectError         a dial failed: unreachable, handshake failed, timed out
        │   ├── AuthFailed       the peer's certificate does not match the pin (or the peer
        │   │                    closed with AUTH_FAILED)
        │   ├── DuplicateNodeError  the peer has OUR node id: a copied home dir
        │   └── Superseded       lost a simultaneous-dial tie-break (``connect`` handles it)
        ├── ClosedError          you closed it (the connection or stream), then used it
        └── StreamLost           a stream ended without its terminal frame: never a success
            ├── StreamReset      the peer reset the stream (``.code``: an ErrorCode)
            ├── IncompleteResponse  clean EOF but no END (or no BODY_END) frame arrived
            └── ConnectionLost   the whole connection died (peer closed, ping timeout, idle)

``ClosedError`` is "you closed it"; ``StreamLost`` and below are "the peer or the network broke
it" (trio's ClosedResourceError vs BrokenResourceError). Code that handles peer input catches
``MeshError``, never ``ValueError``: every way a peer or a person can be wrong is in this tree.
"""

from __future__ import annotations


class MeshError(Exception):
    """Root of every error mesh raises on purpose."""


class NodeError(MeshError):
    """The node cannot start: a bad configuration or a worker that never came up."""


class AddressError(MeshError):
    """An address that is not ``HOST:PORT`` (or ``[v6]:PORT``)."""


class InviteError(MeshError):
    """An invite token that is malformed, of another version, or expired; or a bad TTL."""


class MembershipError(MeshError):
    """This node cannot be (or become) a member: bad token, join refused, another mesh."""


class HandshakeInputError(MeshError):
    """The peer sent something that is not a membership handshake message."""


class GossipDecodeError(MeshError):
    """Gossip bytes or a gossip dict that is not a valid gossip message."""


class UnknownGossipType(GossipDecodeError):
    """A gossip message of a type this version does not know: ignored, never a broken link."""


class IdentityError(MeshError):
    """The node identity in the home dir is unusable."""


class FrameError(MeshError):
    """Bytes that do not decode to valid tunnel frames (the codec's only error type)."""


class ProtocolViolation(FrameError):
    """Valid frames in a forbidden order (e.g. DATA before the response HEAD)."""


class CopyError(MeshError):
    """Copying a model from peers failed; ``str()`` is one sentence, the store is unchanged."""


class ManifestError(CopyError):
    """A model manifest that is malformed, unsafe (paths) or not self-consistent."""


class ChunkMismatch(CopyError):
    """Bytes that do not hash to what the manifest says (the sending peer is dropped)."""


class CopyRefused(CopyError):
    """The peer refused a request; ``kind`` says why (``unknown_model``, ``busy``, ...)."""

    def __init__(self, message: str, kind: str = "refused") -> None:
        super().__init__(message)
        self.kind = kind


class PeerLost(CopyError):
    """No peer that holds the model is left to copy from."""


class DiskFull(CopyError):
    """The store's file system has no room for the copy."""


class SplitError(MeshError):
    """Serving one model across several nodes (``mesh.split``) failed."""


class PlanError(SplitError):
    """No set of members that offer memory can hold the model; the message says why, once."""


class TunnelError(MeshError):
    """Root of QUIC tunnel errors."""


class ConnectError(TunnelError):
    """Dialing a peer failed before a usable connection existed."""


class AuthFailed(ConnectError):
    """The peer's certificate did not match the pin, or the peer refused us (AUTH_FAILED)."""


class DuplicateNodeError(ConnectError):
    """The peer presented our own node id: two nodes run from one (copied) home dir."""


class Superseded(ConnectError):
    """This dial lost a simultaneous-dial tie-break; the endpoint keeps the other connection."""


class ClosedError(TunnelError):
    """Used a connection or stream after closing it ourselves."""


class StreamLost(TunnelError):
    """The stream ended without its terminal frame. Never treat as success."""

    def __init__(self, message: str = "", code: int | None = None) -> None:
        super().__init__(message or type(self).__name__)
        self.code = code


class StreamReset(StreamLost):
    """The peer reset the stream; ``code`` is the ErrorCode it gave."""


class IncompleteResponse(StreamLost):
    """The peer finished the stream cleanly but its terminal frame (END/BODY_END) never came."""


class ConnectionLost(StreamLost):
    """The connection carrying the stream died; ``code`` is the close code if one was given."""
