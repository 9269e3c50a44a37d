"""``mesh members list`` and ``mesh members remove NODE``: who is in the mesh, and taking one out.

Both ask the RUNNING node over its gateway (like ``mesh invite``); a removal is persisted and
gossiped, so every member drops the node, closes its link and forgets its pin.
"""

from __future__ import annotations

from pathlib import Path

import orjson
import typer
from rich.table import Table

from mesh.cli.app import HomeOption, app, console, resolve_home
from mesh.cli.mesh_cmds import call_node

members_app = typer.Typer(help="List or remove the members of this mesh.", no_args_is_help=True)
app.add_typer(members_app, name="members")


@members_app.command("list")
def list_command(
    home: Path | None = HomeOption,
    as_json: bool = typer.Option(False, "--json", help="Print the raw JSON."),
) -> None:
    """Every member of the mesh: node id, addresses, and whether this node is linked to it."""
    rows = call_node(resolve_home(home), "GET", "/api/mesh/members")["members"]
    if as_json:
        print(orjson.dumps(rows, option=orjson.OPT_INDENT_2).decode())
        return
    table = Table(title="members", title_justify="left")
    for column in ("node", "addresses", "link"):
        table.add_column(column)
    for row in rows:
        link = "this node" if row.get("self") else ("linked" if row.get("connected") else "-")
        table.add_row(row["node_id"][:16], ", ".join(row.get("addresses", [])), link)
    console.print(table)


@members_app.command("remove")
def remove_command(
    node: str = typer.Argument(..., help="The member's node id, or a unique prefix of it."),
    home: Path | None = HomeOption,
) -> None:
    """Remove a member: every node drops it, closes its link and refuses it from now on (it can
    come back only with a fresh invite)."""
    data = call_node(resolve_home(home), "POST", "/api/mesh/members/remove", {"node": node})
    console.print(f"removed {data['removed']} from the mesh", highlight=False)
