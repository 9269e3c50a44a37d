"""``mesh status``: the "split models" section drawn from the /api/status picture."""

from __future__ import annotations

from typing import Any

import pytest
from split_pictures import SELF, STAGES, WHY, B, C, split_node
from typer.testing import CliRunner

from mesh.cli import app, mesh_cmds
from mesh.cli.split_view import split_section


def picture() -> dict[str, Any]:
    """A node heading BIG over three nodes, waiting for memory for HUGE, running a rank of
    OTHER for C; B offers memory, C serves a split model of its own with a stage here."""
    return {
        "node": split_node(),
        "peers": [
            {"node_id": B, "state": "up", "models": [], "share_memory": 8_000_000_000,
             "share_memory_used": 2_500_000_000},
            {"node_id": C, "state": "up", "models": [{"name": "OTHER", "stages": [
                {"rank": 1, "node_id": SELF, "start": 0, "end": 1},
                {"rank": 0, "node_id": C, "start": 1, "end": 4}]}]},
            # A peer that is down serves nothing: its split model is not shown.
            {"node_id": "d" * 64, "state": "down", "models": [{"name": "GONE", "stages": STAGES}]},
        ],
    }  # fmt: skip


def test_split_section_draws_stages_offers_ranks_and_waiting() -> None:
    assert split_section(picture()).splitlines() == [
        "split models",
        "  BIG  24 layers over 3 ranks, served by this node",
        f"    rank 2  {B[:12]}  layers 0-9",
        f"    rank 1  {C[:12]}  layers 10-17",
        "    rank 0  this node     layers 18-23",
        f"  OTHER  4 layers over 2 ranks, served by {C[:12]}",
        "    rank 1  this node     layer 0",
        f"    rank 0  {C[:12]}  layers 1-3",
        f"  this node runs rank 1 of OTHER for {C[:12]}",
        f"  HUGE waits for members to offer memory: {WHY}",
        "  memory offered for ranks (mesh up --share-memory):",
        "    this node     4.0 GB, 1.2 GB in use",
        f"    {B[:12]}  8.0 GB, 2.5 GB in use",
    ]


def test_split_section_is_empty_without_splits_or_offers() -> None:
    plain = {"node": {"node_id": SELF, "models": [{"name": "tiny", "stages": []}]}, "peers": []}
    assert split_section(plain) == ""
    assert split_section({"node": {"node_id": SELF, "split": {"groups": {"X": []}}}}) == ""


def test_split_section_says_when_nobody_offers_memory() -> None:
    status = {
        "node": {"node_id": SELF, "split": {"waiting": {"HUGE": WHY}}},
        "peers": [],
        "workers": {"HUGE": {"split": {"waiting": WHY}}, "NEW": {"split": {"forming": True}}},
    }
    assert split_section(status).splitlines() == [
        "split models",
        "  NEW: forming its group",
        f"  HUGE waits for members to offer memory: {WHY}",
        "  no member offers memory for ranks (mesh up --share-memory GB)",
    ]


def test_status_command_prints_the_section_below_the_peers(monkeypatch: pytest.MonkeyPatch) -> None:
    status = picture()
    status["node"]["split"]["waiting"] = {"[bold]HUGE[/]": "it waits [red]for[/] memory."}
    monkeypatch.setattr(mesh_cmds, "call_node", lambda home, method, path: status)
    result = CliRunner().invoke(app, ["status"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    out = result.output
    assert out.index("peers") < out.index("split models") < out.index("rank 0  this node")
    # Names and sentences from peers are printed as they are, never as rich markup.
    assert "[bold]HUGE[/] waits for members to offer memory: it waits [red]for[/] memory." in out
