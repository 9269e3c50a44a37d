"""The SQLite response store: round trip, persistence, bounds (oldest out), privacy."""

from __future__ import annotations

import os
import sqlite3

import pytest

from gateway.responses.state import LocalResponses, new_response_id, owner_tag
from gateway.responses.store import ResponseStore, StoredResponse


def _item(n: int, text: str = "x") -> StoredResponse:
    return StoredResponse(
        id=f"resp_{n}",
        response={"id": f"resp_{n}", "status": "completed", "output": [{"text": text}]},
        input_items=[{"type": "message", "role": "user", "content": text}],
        context=[{"type": "message", "role": "user", "content": text}],
        created_at=float(n),
    )


def test_round_trip_survives_a_reopen(tmp_path):
    path = tmp_path / "responses.sqlite3"
    store = ResponseStore(path)
    store.put(_item(1, "hello"))
    store.close()
    again = ResponseStore(path)
    got = again.get("resp_1")
    assert got is not None and got.response["output"] == [{"text": "hello"}]
    assert got.context == _item(1, "hello").context and got.status == "completed"
    assert again.get("resp_2") is None
    mode = sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"
    assert os.stat(path).st_mode & 0o777 == 0o600


def test_put_again_replaces_the_row():
    store = ResponseStore(None)
    store.put(_item(1))
    updated = _item(1)
    updated.response["status"] = "cancelled"
    store.put(updated)
    assert store.get("resp_1").status == "cancelled"  # type: ignore[union-attr]
    assert store.stats()["responses"] == 1


def test_the_oldest_go_first_beyond_the_count():
    store = ResponseStore(None, max_responses=3)
    for n in range(5):
        store.put(_item(n))
    assert [n for n in range(5) if store.get(f"resp_{n}")] == [2, 3, 4]


def test_the_oldest_go_first_beyond_the_bytes_but_the_newest_stays():
    store = ResponseStore(None, max_bytes=2_000)
    big = os.urandom(3_000).hex()  # incompressible: alone over the bound
    for n in range(3):
        store.put(_item(n, big))
    assert store.get("resp_2") is not None
    assert store.get("resp_0") is None and store.get("resp_1") is None


def test_delete():
    store = ResponseStore(None)
    store.put(_item(1))
    assert store.delete("resp_1") and not store.delete("resp_1")
    assert store.get("resp_1") is None


def test_bounds_must_leave_room():
    with pytest.raises(ValueError):
        ResponseStore(None, max_responses=0)


def test_ids_name_their_node():
    rid = new_response_id("ab12cd34ef56")
    assert rid.startswith("resp_ab12cd34ef56_") and owner_tag(rid) == "ab12cd34ef56"
    assert owner_tag(new_response_id()) == "" and owner_tag("resp_abc") == ""
    local = LocalResponses(ResponseStore(None), node_tag="ab12cd34ef56")
    assert local.owns(local.new_id()) and local.owns("resp_old") and not local.owns("resp_ff_1")


def test_unfinished_responses_fail_at_the_next_start(tmp_path):
    store = ResponseStore(tmp_path / "r.sqlite3")
    running = _item(1)
    running.response["status"] = "in_progress"
    store.put(running)
    store.put(_item(2))
    assert store.fail_unfinished("restarted") == 1
    failed = store.get("resp_1")
    assert failed is not None and failed.status == "failed"
    assert failed.response["error"]["message"] == "restarted"
    assert store.get("resp_2").status == "completed"  # type: ignore[union-attr]
