"""``mesh members list`` and ``mesh members remove NODE``: who is in the mesh, and taking one out.

Both ask the RUNNING node over its gateway (like ``mesh invite``); a removal is signed by that
node, persisted and gossiped, so every member drops the node (and those it alone admitted),
closes their links and forgets their pins.
"""

from __future__ import annotations

import time
from pathlib import Path

import orjson
import typer
from rich.table import Table

from mesh.cli.app import HomeOption, app, console, resolve_home
from mesh.cli.mesh_cmds import call_node
from mesh.membership.facts import KEPT, MIGRATED

members_app = typer.Typer(help="List or remove the members of this mesh.", no_args_is_help=True)
app.add_typer(members_app, name="members")


def _when(at: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(at)) if at else "-"


def _short(node_id: str | None) -> str:
    return node_id[:12] if node_id else "-"


@members_app.command("list")
def list_command(
    home: Path | None = HomeOption,
    as_json: bool = typer.Option(False, "--json", help="Print the raw JSON."),
) -> None:
    """Every member of the mesh (node id, addresses, whether this node is linked to it, who
    admitted it and when) and every removed node (who removed it and when)."""
    data = call_node(resolve_home(home), "GET", "/api/mesh/members")
    if as_json:
        print(orjson.dumps(data, option=orjson.OPT_INDENT_2).decode())
        return
    table = Table(title="members", title_justify="left")
    for column in ("node", "addresses", "link", "admitted by", "when"):
        table.add_column(column)
    for row in data["members"]:
        link = "this node" if row.get("self") else ("linked" if row.get("connected") else "-")
        admitted = "root" if row.get("root") else _short(row.get("admitted_by"))
        if row.get("invite") in (MIGRATED, KEPT):
            admitted += f" ({row['invite']})"
        table.add_row(
            row["node_id"][:16],
            ", ".join(row.get("addresses", [])),
            link,
            admitted,
            _when(row.get("admitted_at")),
        )
    console.print(table)
    removed = data.get("removed") or []
    if removed:
        gone = Table(title="removed", title_justify="left")
        for column in ("node", "removed by", "when", "admitted by"):
            gone.add_column(column)
        for row in removed:
            gone.add_row(
                row["node_id"][:16],
                _short(row.get("removed_by")),
                _when(row.get("removed_at")),
                _short(row.get("admitted_by")),
            )
        console.print(gone)


@members_app.command("remove")
def remove_command(
    node: str = typer.Argument(..., help="The member's node id, or a unique prefix of it."),
    keep: list[str] = typer.Option(
        [], "--keep", help="A member it admitted that stays (this node admits it): repeatable."
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="Only say who would go with it."),
    home: Path | None = HomeOption,
) -> None:
    """Remove a member, and the members it alone admitted (but --keep ones): every node drops
    them, closes their links and refuses them from now on (they can come back only as new
    nodes, with a fresh invite); the mesh secret is rotated."""
    body = {"node": node, "keep": keep, "dry_run": dry_run}
    data = call_node(resolve_home(home), "POST", "/api/mesh/members/remove", body)
    going = ", ".join(n[:12] for n in data.get("going_with", []))
    if dry_run:
        console.print(
            f"would remove {data['removed']}" + (f" and with it: {going}" if going else ""),
            highlight=False,
        )
        return
    console.print(f"removed {data['removed']} from the mesh", highlight=False)
    if going:
        console.print(f"and with it (admitted through it): {going}", highlight=False)
    if data.get("kept"):
        console.print(f"kept: {', '.join(n[:12] for n in data['kept'])}", highlight=False)
