"""The wire schema of split serving across nodes: the head's order to run a rank, and the rank
host's reports back. Sans-IO.

One tunnel stream per remote rank, opened by the head (the node that serves the model and
runs rank 0) to the member that is to run the rank, and kept open for the group's life::

    → RequestHead{path=/mesh/v1/split/rank} Body(RankOrder JSON)
    ← ResponseHead{200} Data({"state": "loading"}) Data({"state": "running"}) ...
    → Body(b"wake") ...                     wake the dozing rank (its stdin gets a byte)
    ← Data({"state": "exited", "code": N, "why": "..."}) End        the rank process ended
    ← ResponseHead{4xx/409, x-error} End(REJECTED)                   refused, in one sentence
    → reset (or BodyEnd)                                             the head ended the group

The stream is the rank's lease: when it ends for any reason (the head ended the group, the
link is lost) the host kills the rank; when the rank exits the host ends the stream, and the
head tears the group down and re-forms it. Every node in the group reaches every other one's
rank through its ring bridge (mesh/split/bridge.py); the order says which node runs which rank,
and each node finds the others' bridges from its own links and their gossip.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from mesh.errors import SplitError

SPLIT_RANK_PATH = "/mesh/v1/split/rank"
_GROUP = re.compile(r"^[A-Za-z0-9._-]{1,64}$")  # also the bridge header's group syntax
MAX_RANKS = 64
MAX_FILES = 4096


class RankOrder(BaseModel):
    """Run rank ``rank`` of group ``group``: ``model``'s layers as ``split`` assigns them.

    ``nodes[r]`` is the node id that runs rank ``r``. ``files`` are the model's files this rank
    needs (its layers' shards, the shared weights, config and tokenizer), copied from the head
    with peer copy when this node's store does not hold the model. ``need_bytes`` is the plan's
    cost of the stage (weights + KV + shared), checked against this node's offer."""

    model_config = ConfigDict(extra="ignore")

    group: str
    model: str
    rank: int = Field(ge=1, lt=MAX_RANKS)
    split: list[int] = Field(min_length=2, max_length=MAX_RANKS)
    nodes: list[str] = Field(min_length=2, max_length=MAX_RANKS)
    files: list[str] = Field(default_factory=list, max_length=MAX_FILES)
    need_bytes: int = Field(ge=1)
    # The lockstep wire the head's rank 0 speaks (worker/split/signals.py); 1: an older head.
    lockstep: int = 1

    @field_validator("group")
    @classmethod
    def _group_syntax(cls, value: str) -> str:
        if not _GROUP.match(value):
            raise ValueError("a group id is 1-64 letters, digits, '.', '_' or '-'")
        return value

    @field_validator("model")
    @classmethod
    def _store_name(cls, value: str) -> str:
        # A store name, never a path: a member must not make this node load from anywhere.
        from worker.store import InvalidModelNameError, check_name

        try:
            return check_name(value)
        except InvalidModelNameError as exc:
            raise ValueError(str(exc)) from None

    @field_validator("split")
    @classmethod
    def _layers(cls, value: list[int]) -> list[int]:
        if any(n < 1 for n in value):
            raise ValueError("every rank runs at least one layer")
        return value

    @field_validator("files")
    @classmethod
    def _relative(cls, value: list[str]) -> list[str]:
        for path in value:
            parts = path.split("/")
            if not path or path.startswith("/") or ".." in parts or "" in parts:
                raise ValueError(f"not a relative file path: {path!r}")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> RankOrder:
        if len(self.nodes) != len(self.split):
            raise ValueError("one node per rank")
        if self.rank >= len(self.split):
            raise ValueError("rank out of range")
        return self


class RankReport(BaseModel):
    """What the rank host says about its rank while the group lives."""

    model_config = ConfigDict(extra="ignore")

    state: Literal["loading", "running", "exited"]
    code: int | None = None
    why: str = ""


class BadOrder(SplitError):
    """A rank order or report that does not parse (a bug or a hostile member)."""


def order_from_json(data: bytes) -> RankOrder:
    try:
        return RankOrder.model_validate_json(data)
    except ValidationError as exc:
        raise BadOrder(f"bad rank order: {_first(exc)}") from None


def report_from_json(data: bytes) -> RankReport:
    try:
        return RankReport.model_validate_json(data)
    except ValidationError as exc:
        raise BadOrder(f"bad rank report: {_first(exc)}") from None


def _first(exc: ValidationError) -> str:
    error = exc.errors()[0]
    where = ".".join(str(p) for p in error["loc"]) or "body"
    return f"{where}: {error['msg']}"
