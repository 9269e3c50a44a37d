"""``mesh id``, ``mesh invite`` and ``mesh status``: who this node is, invite others, look around.

``invite`` and ``status`` ask the RUNNING node (found through ``<home>/node.json``) over its
gateway's HTTP API, so they see the live mesh, and the invite is remembered by the node that
will accept it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import typer
from rich.table import Table
from rich.text import Text

from mesh.cli.app import HomeOption, app, console, fail, resolve_home
from mesh.cli.cache_view import COLUMNS, cache_cells
from mesh.cli.split_view import split_section


def call_node(home: Path, method: str, path: str, body: dict | None = None) -> Any:
    """Call the running node's HTTP API (found through node.json); one sentence on failure."""
    from mesh.cli.chat import ChatError, find_node

    try:
        node = find_node(home)
    except ChatError as exc:
        raise fail(str(exc)) from exc
    headers = {"authorization": f"Bearer {node.api_key}"} if node.api_key else {}
    if node.csrf:
        headers["x-mesh-csrf"] = node.csrf
    try:
        response = httpx.request(method, node.url + path, json=body, headers=headers, timeout=10.0)
    except httpx.HTTPError as exc:
        raise fail(f"cannot reach the node at {node.url}: {exc}") from exc
    try:
        data = response.json()
    except ValueError:
        data = {}
    if response.status_code != 200:
        message = data.get("error", {}).get("message") if isinstance(data, dict) else None
        raise fail(f"the node answered {response.status_code}: {message or response.text[:200]}")
    return data


@app.command("id")
def id_command(home: Path | None = HomeOption) -> None:
    """Print this node's id (creating its identity if it has none yet) and its mesh."""
    from mesh.errors import IdentityError
    from mesh.identity import NodeIdentity
    from mesh.membership.members import load_credentials

    home_dir = resolve_home(home)
    try:
        identity = NodeIdentity.load_or_create(home_dir)
    except IdentityError as exc:
        raise fail(str(exc)) from exc
    credentials = load_credentials(home_dir)
    print(f"certificate fingerprint: {identity.cert_fingerprint}")
    print(f"mesh: {credentials.mesh_id if credentials else '(none yet)'}")
    print(identity.node_id)


@app.command("invite")
def invite_command(
    home: Path | None = HomeOption,
    ttl: str = typer.Option("1h", "--ttl", help="How long the token is valid: 90s, 15m, 1h, 2d."),
) -> None:
    """Mint a one-use invite token on the running node; the token is the last line printed."""
    from mesh.membership.invite import InviteError, parse_ttl

    try:
        ttl_s = parse_ttl(ttl)
    except InviteError as exc:
        raise fail(str(exc)) from exc
    data = call_node(resolve_home(home), "POST", "/api/mesh/invite", {"ttl_s": ttl_s})
    minutes = max(0.0, (data.get("expires_at", 0) - time.time()) / 60)
    console.print(
        f"one-use invite, valid {minutes:.0f} min; on the new node run: mesh up --join TOKEN",
        highlight=False,
    )
    print(data["token"], flush=True)


@app.command("status")
def status_command(
    home: Path | None = HomeOption,
    as_json: bool = typer.Option(False, "--json", help="Print the raw JSON status."),
) -> None:
    """Show this node and every peer (models, load, RTT, last seen, state), every node's prompt
    caches (memory and disk tier, prefixes, hit rate, budget), then split models."""
    data = call_node(resolve_home(home), "GET", "/api/status")
    if as_json:
        print(orjson.dumps(data, option=orjson.OPT_INDENT_2).decode())
        return
    node = data["node"]
    models = ", ".join(m["name"] for m in node.get("models", [])) or "-"
    console.print(
        f"[bold]node[/] {node['node_id'][:16]}  mesh {node.get('mesh_id', '?')}  "
        f"members {node.get('members', '?')}  models {models}  "
        f"queue {node.get('queue_depth', 0)}  in-flight {node.get('in_flight', 0)}",
        highlight=False,
    )
    table = Table(title="peers", title_justify="left")
    for column in ("node", "state", "addresses", "models", "load", "tok/s", "rtt ms", "seen s"):
        table.add_column(column)
    for peer in data.get("peers", []):
        state = peer["state"] + ("" if peer.get("connected") else " (no link)")
        table.add_row(
            peer["node_id"][:16],
            state,
            ", ".join(peer.get("addresses", [])),
            ", ".join(m["name"] for m in peer.get("models", [])) or "-",
            f"{peer.get('queue_depth', 0)}q/{peer.get('in_flight', 0)}r",
            f"{peer.get('tok_s', 0.0):.1f}",
            "-" if peer.get("rtt_ms") is None else f"{peer['rtt_ms']:.1f}",
            f"{peer.get('last_seen_s', 0):.1f}",
        )
    console.print(table)
    caches = cache_cells(data)
    if caches:
        cache_table = Table(title="prompt caches", title_justify="left")
        for column in COLUMNS:
            cache_table.add_column(column)
        for row in caches:  # Text: names come from peers, never rich markup
            cache_table.add_row(*(Text(cell) for cell in row))
        console.print(cache_table)
    split = split_section(data)
    if split:
        # Plain text: model names and sentences come from peers, never rich markup.
        console.print(split, markup=False, highlight=False)
