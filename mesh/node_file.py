"""``<home>/node.json``: where the running node is, for ``mesh chat``, ``mesh invite`` and friends.

The node writes it once its gateway listens and removes it on shutdown; the file may hold the
API key, so it is written 0600 and replaced atomically (readers never see half a file).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import orjson

from mesh.files import write_private

NODE_FILE = "node.json"


class NodeFileError(Exception):
    """``node.json`` is missing or unreadable; ``str()`` is one clear sentence."""


def node_file_path(home: Path) -> Path:
    return home / NODE_FILE


def write_node_file(home: Path, info: dict[str, Any]) -> None:
    write_private(node_file_path(home), orjson.dumps(info, option=orjson.OPT_INDENT_2))


def remove_node_file(home: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        node_file_path(home).unlink()


def read_node_file(home: Path) -> dict[str, Any]:
    """The recorded node's facts; raises ``NodeFileError`` with a sentence a person can act on."""
    path = node_file_path(home)
    try:
        info = orjson.loads(path.read_bytes())
    except FileNotFoundError:
        raise NodeFileError(
            f"no node is running for {home} (no {path}); start one with `mesh up` or pass --url"
        ) from None
    except (OSError, orjson.JSONDecodeError) as exc:
        raise NodeFileError(f"cannot read {path}: {exc}") from None
    if not isinstance(info, dict) or not isinstance(info.get("url"), str):
        raise NodeFileError(f"{path} has no node url; restart the node with `mesh up`")
    return info
