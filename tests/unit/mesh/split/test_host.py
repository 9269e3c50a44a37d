"""A member's rank host refuses what it must, in words, before starting anything: orders
that do not parse, that do not come from the group's head, that give this node no rank of its
own, that would use more than its offer; and a rank order cannot name a path or a file
outside the model."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from mesh.errors import SplitError
from mesh.identity import NodeIdentity
from mesh.split.bridge import BridgeServer
from mesh.split.host import RankHost
from mesh.split.orders import BadOrder, order_from_json
from mesh.tunnel.frames import End, ResponseHead
from worker.split.signals import LOCKSTEP_VERSION

HEAD = "h" * 64


class RecordingStream:
    def __init__(self) -> None:
        self.sent: list[object] = []

    async def send(self, frame: object, *, defer: bool = False) -> None:
        self.sent.append(frame)


def order(me: str, **changes: object) -> bytes:
    body = {
        "group": "g1",
        "model": "tiny6",
        "rank": 1,
        "split": [3, 3],
        "nodes": [HEAD, me],
        "files": ["config.json", "model.safetensors"],
        "need_bytes": 10_000_000,
        "lockstep": LOCKSTEP_VERSION,
    }
    return orjson.dumps(body | changes)


@pytest.fixture
def host(tmp_path: Path) -> RankHost:
    identity = NodeIdentity.generate()
    return RankHost(
        tmp_path,
        identity,
        offered_bytes=50_000_000,
        bridge=BridgeServer(identity, list),
        bridge_of=lambda node_id: None,
        copy_from=lambda node_id, name: [],
    )


@pytest.mark.parametrize(
    ("changes", "peer", "status", "words"),
    [
        ({}, "x" * 64, 400, "only the node that runs rank 0"),
        ({"nodes": [HEAD, HEAD]}, HEAD, 400, "exactly its one rank"),
        ({"need_bytes": 60_000_000}, HEAD, 409, "offer has 50 MB left"),
        ({"split": [3]}, HEAD, 400, "bad rank order"),
        ({"lockstep": 1}, HEAD, 400, "same mlx-mesh version"),
    ],
)
async def test_refusals_are_one_sentence_and_start_nothing(
    host: RankHost, changes: dict, peer: str, status: int, words: str
) -> None:
    stream = RecordingStream()
    await host.serve(stream, order(host.node_id, **changes), peer)
    head, end = stream.sent
    assert isinstance(head, ResponseHead) and head.status == status
    assert words in head.headers["x-error"] and "\n" not in head.headers["x-error"]
    assert isinstance(end, End)
    assert host.ranks == {}


@pytest.mark.parametrize(
    "changes",
    [
        {"model": "../../etc"},
        {"model": "/tmp/model"},
        {"files": ["../secret"]},
        {"files": ["/etc/passwd"]},
        {"files": ["a//b"]},
        {"group": "g 1"},
        {"rank": 0},
        {"need_bytes": 0},
    ],
)
def test_an_order_names_no_path_outside_the_model(changes: dict) -> None:
    with pytest.raises(BadOrder):
        order_from_json(order("m" * 64, **changes))


def test_bad_order_is_a_split_error() -> None:
    assert issubclass(BadOrder, SplitError)
