"""``mesh models pull`` through the running node: copy a model from the members that hold it.

The node does the copy (it holds the pinned links and knows who holds what); this module starts
it over the node's admin API and draws the NDJSON progress stream it answers with.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import orjson

from mesh.cli.app import err_console, fail
from mesh.cli.chat import ChatError, NodeAddress, find_node


class NoHolder(Exception):
    """No linked member holds the model (the caller may fall back to the registry)."""


def running_node(home: Path) -> NodeAddress | None:
    try:
        return find_node(home)
    except ChatError:
        return None


def _headers(node: NodeAddress) -> dict[str, str]:
    headers = {"authorization": f"Bearer {node.api_key}"} if node.api_key else {}
    if node.csrf:
        headers["x-mesh-csrf"] = node.csrf
    return headers


def holders(node: NodeAddress) -> dict[str, Any] | None:
    """``GET /api/mesh/models`` of the running node; None if it cannot say."""
    try:
        response = httpx.get(node.url + "/api/mesh/models", headers=_headers(node), timeout=5.0)
        return response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def pull_from_peers(node: NodeAddress, name: str, from_node: str | None) -> str:
    """Copy NAME into the store through the node; its path. ``NoHolder`` when nobody has it."""
    from mesh.cli.progress import CopyBars

    body: dict[str, Any] = {"name": name} | ({"from": from_node} if from_node else {})
    url = node.url + "/api/mesh/models/pull"
    try:
        with (
            httpx.stream(
                "POST",
                url,
                json=body,
                headers=_headers(node),
                timeout=httpx.Timeout(10.0, read=120.0),
            ) as response,
            CopyBars(err_console) as bars,
        ):
            if response.status_code == 404:
                raise NoHolder()
            if response.status_code != 200:
                response.read()
                raise fail(f"the node refused the copy: {_message(response)}")
            for line in response.iter_lines():
                event = orjson.loads(line) if line else {}
                if event.get("type") == "progress":
                    bars.update(event)
                elif event.get("type") == "done":
                    return str(event["path"])
                elif event.get("type") == "error":
                    raise fail(event.get("message", "the copy failed"))
    except httpx.HTTPError as exc:
        raise fail(f"lost the node at {node.url} during the copy: {exc}") from exc
    raise fail("the node ended the copy without saying how it went; pull again to resume")


def _message(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:200]
