"""Fault scenarios: a TOML file → a validated :class:`Scenario` (pure, no I/O beyond reading).

A scenario names its nodes, what the probe does, and a timeline of steps at seconds after the
probe starts (t=0 is when every initial node is up and sees the others)::

    name = "asymmetric-loss"
    duration_s = 40
    [[nodes]]              # node 0 creates the mesh; the probe talks to probe.target
    [[nodes]]
    model = "tiny"         # "tiny": a random-weight test model built for the run
    [probe]
    models = ["tiny-1"]    # node i's tiny model is served as "tiny-<i>"
    [[steps]]
    at = 10
    action = "fault"
    link = "0->1"          # one way; "0<->1" both ways
    loss = 0.05
    [expect]
    min_success = 0.95     # the floor: this fraction of fault-phase requests succeed
    max_time_to_error_s = 5

Actions: ``fault`` (loss, delay_ms, jitter_ms, duplicate, blackhole, bandwidth_kbps on a link),
``clear`` (one link, or every link), ``partition`` (groups; blackholes every link between
groups), ``heal`` (clears every fault), ``kill`` (SIGKILL), ``stop`` (SIGSTOP), ``cont``
(SIGCONT), ``restart`` (start a killed node again, same home), ``join`` (start a node declared
``start = false`` and join it with a fresh invite), ``slow`` (duty-cycle SIGSTOP/SIGCONT on a
node's worker process: ``duty`` = running fraction, 1.0 ends it).

A run fails on any hung or improperly failed request (timeout, cut-off body, refused
connection, a 5xx other than a 503 with Retry-After), on an error slower than
``max_time_to_error_s``, on fault-phase success below ``min_success``, and on no (or slow)
recovery. ``probe.sentinel = true`` adds a non-stream request beside each stream.
"""

from __future__ import annotations

import itertools
import re
import tomllib
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from lab.rows import ApiName

_LINK = re.compile(r"^\s*(\d+)\s*(->|<-|<->)\s*(\d+)\s*$")


class ScenarioError(ValueError):
    """A scenario file that does not parse or does not make sense; the message says where."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FaultSettings(_Strict):
    """Faults for one direction of one link (what the chaos proxy applies)."""

    loss: float = Field(0.0, ge=0, le=1)
    delay_ms: float = Field(0.0, ge=0)
    jitter_ms: float = Field(0.0, ge=0)
    duplicate: float = Field(0.0, ge=0, le=1)
    blackhole: bool = False
    bandwidth_kbps: float | None = Field(None, gt=0)


def parse_link(text: str) -> list[tuple[int, int]]:
    """``"0->1"`` → [(0, 1)], ``"0<-1"`` → [(1, 0)], ``"0<->1"`` → [(0, 1), (1, 0)]."""
    match = _LINK.match(text)
    if not match:
        raise ValueError(f"bad link {text!r}: write it as 0->1, 0<-1 or 0<->1")
    a, arrow, b = int(match[1]), match[2], int(match[3])
    if a == b:
        raise ValueError(f"bad link {text!r}: a link joins two different nodes")
    return {"->": [(a, b)], "<-": [(b, a)], "<->": [(a, b), (b, a)]}[arrow]


def partition_directions(groups: list[list[int]]) -> list[tuple[int, int]]:
    """Every direction between two nodes of different groups."""
    out: list[tuple[int, int]] = []
    for left, right in itertools.permutations(range(len(groups)), 2):
        out += [(a, b) for a in groups[left] for b in groups[right]]
    return out


class _Step(_Strict):
    at: float = Field(ge=0, description="seconds after the probe started")


class FaultStep(_Step, FaultSettings):
    action: Literal["fault"]
    link: str

    @field_validator("link")
    @classmethod
    def _link(cls, value: str) -> str:
        parse_link(value)
        return value

    @property
    def directions(self) -> list[tuple[int, int]]:
        return parse_link(self.link)

    @property
    def settings(self) -> FaultSettings:
        return FaultSettings(**{name: getattr(self, name) for name in FaultSettings.model_fields})


class ClearStep(_Step):
    action: Literal["clear"]
    link: str | None = None  # None: every link

    @field_validator("link")
    @classmethod
    def _link(cls, value: str | None) -> str | None:
        if value is not None:
            parse_link(value)
        return value


class PartitionStep(_Step):
    action: Literal["partition"]
    groups: list[list[int]] = Field(min_length=2)

    @field_validator("groups")
    @classmethod
    def _disjoint(cls, groups: list[list[int]]) -> list[list[int]]:
        seen: set[int] = set()
        for group in groups:
            if not group or seen & set(group):
                raise ValueError("partition groups must be non-empty and disjoint")
            seen |= set(group)
        return groups


class HealStep(_Step):
    action: Literal["heal"]


class NodeStep(_Step):
    action: Literal["kill", "stop", "cont", "restart", "join"]
    node: int = Field(ge=0)


class SlowStep(_Step):
    action: Literal["slow"]
    node: int = Field(ge=0)
    duty: float = Field(gt=0, le=1, description="fraction of each period the worker may run")
    period_ms: float = Field(200.0, gt=0)


Step = Annotated[
    FaultStep | ClearStep | PartitionStep | HealStep | NodeStep | SlowStep,
    Field(discriminator="action"),
]


class NodeSpec(_Strict):
    # "tiny" (served as tiny-<index>), "tiny:<name>" (a tiny model served as <name>; nodes with
    # the same name get the same weights), "none" (gateway only: `mesh up --no-worker`), or a
    # real model name/path for `mesh up --model`.
    model: str = "tiny"
    start: bool = True  # False: started by a later `join` step

    @property
    def is_tiny(self) -> bool:
        return self.model == "tiny" or self.model.startswith("tiny:")

    @property
    def serves(self) -> bool:
        return self.model != "none"

    def model_id(self, index: int) -> str:
        """The id this node serves its model under ("none" for a gateway-only node)."""
        if self.model == "tiny":
            return f"tiny-{index}"
        return self.model.removeprefix("tiny:")


class ProbeSpec(_Strict):
    target: int = Field(0, ge=0)
    apis: list[ApiName] = Field(default_factory=lambda: ["chat"], min_length=1)
    models: list[str] | None = None  # None: every model the target lists
    include_mesh: bool = False
    sentinel: bool = False
    interval_s: float = Field(1.0, gt=0)
    timeout_s: float = Field(30.0, gt=0)
    max_tokens: int = Field(8, gt=0)


class Expectations(_Strict):
    """What a run must show to pass; improper failures (see ``lab.rows``) always fail it."""

    max_hung: int = Field(0, ge=0)
    # The floor: the fraction of fault-phase requests that must succeed. Required of every
    # scenario with steps, so no fault scenario passes on "nothing hung" alone.
    min_success: float | None = Field(None, ge=0, le=1)
    # Every failed request must have ended within this many seconds of its start: a proper
    # error that takes 28 s is a client stuck for 28 s.
    max_time_to_error_s: float = Field(5.0, gt=0)
    recover_within_s: float | None = Field(None, gt=0)


class SessionsSpec(_Strict):
    """Replayed agent sessions instead of the probe (``python -m lab.routing_compare``): each
    session replays ``tests/fixtures/agent_conversation.json`` under its own task line, one
    turn after another, every request entering at a random running node; the run repeats for
    each of ``routings`` (``mesh up --routing``) on a fresh mesh, and each of ``keyless``
    again with no session ids. ``stop_node`` is killed when
    ``stop_at`` of all turns are done and restarted at ``restart_at``; then ``hedge_runs``:
    the last routing with ``--hedge auto`` healthy, and with ``slow_node`` held to
    ``slow_duty`` of the CPU (with ``--hedge off`` and ``auto``)."""

    count: int = Field(12, ge=1)
    routings: list[str] = Field(default_factory=lambda: ["today", "round-robin", "cache"])
    session_keys: bool = True  # send x-session-id, as agent harnesses send their session id
    # Routings run once more without session ids (when the above sends them): a client that
    # sends none, whose next turn only a cache-aware router can place.
    keyless: list[str] = Field(default_factory=list)
    max_tokens: int = Field(16, gt=0)
    seed: int = 25
    stop_node: int | None = 2
    stop_at: float = Field(0.4, ge=0, le=1)
    restart_at: float = Field(0.7, ge=0, le=1)
    hedge_runs: bool = True
    slow_node: int = 1
    slow_duty: float = Field(0.25, gt=0, le=1)
    # Every node's workers' prompt cache (mesh up --prompt-cache-gb); None: the default. Small
    # enough that a node holds only some sessions, where a turn lands decides what it finds.
    prompt_cache_gb: float | None = Field(None, ge=0)
    # Every node's workers' memory budget (mesh up --memory-gb) and disk tier
    # (--prompt-cache-disk-gb); None: the defaults. With a budget, each run samples every node's
    # RSS each second (lab/memory_watch.py) and checks it against budget + weights + its idle
    # RSS + ``rss_margin_mb``.
    memory_gb: float | None = Field(None, gt=0)
    prompt_cache_disk_gb: float | None = Field(None, ge=0)
    rss_margin_mb: float = Field(0.0, ge=0)
    # Routings run once more with no budget (--memory-gb 0), everything else the same: the
    # cached share the budget costs, measured in the same invocation.
    unbounded: list[str] = Field(default_factory=list)


class Scenario(_Strict):
    name: str
    description: str = ""
    duration_s: float = Field(gt=0)
    nodes: list[NodeSpec] = Field(min_length=1)
    probe: ProbeSpec = ProbeSpec()
    steps: list[Step] = Field(default_factory=list)
    expect: Expectations = Expectations()
    sessions: SessionsSpec | None = None

    @model_validator(mode="after")
    def _consistent(self) -> Scenario:
        count = len(self.nodes)
        if not self.nodes[0].start:
            raise ValueError("node 0 creates the mesh: it must start with the run")
        if self.probe.target >= count or not self.nodes[self.probe.target].start:
            raise ValueError(f"probe.target {self.probe.target} is not a node that starts")
        joined: set[int] = set()
        for index, step in enumerate(self.steps):
            where = f"steps[{index}] ({step.action} at {step.at:g}s)"
            if step.at > self.duration_s:
                raise ValueError(f"{where} is after duration_s={self.duration_s:g}")
            nodes = _step_nodes(step)
            if any(n >= count for n in nodes):
                raise ValueError(f"{where} names node {max(nodes)}, but there are {count} nodes")
            if isinstance(step, NodeStep) and step.action == "join":
                if self.nodes[step.node].start or step.node in joined:
                    raise ValueError(f"{where}: only a node with start = false joins, once")
                joined.add(step.node)
        late = {i for i, node in enumerate(self.nodes) if not node.start}
        if late - joined:
            raise ValueError(f"nodes {sorted(late - joined)} never start: add a join step")
        if list(self.steps) != sorted(self.steps, key=lambda s: s.at):
            raise ValueError("steps must be in time order")
        if self.steps and self.expect.min_success is None:
            raise ValueError("a scenario with steps must set expect.min_success (its floor)")
        if self.expect.max_time_to_error_s >= self.probe.timeout_s:
            raise ValueError(
                "expect.max_time_to_error_s must be below probe.timeout_s: "
                "otherwise a request that ran into the deadline is within bounds"
            )
        return self

    @property
    def first_fault_at(self) -> float | None:
        """When the no-fault baseline ends (the first step), or None for a fault-free run."""
        return self.steps[0].at if self.steps else None

    def faulted_pairs(self) -> set[tuple[int, int]]:
        """Node pairs (low, high) whose link some step faults: bypassing those voids the run."""
        pairs: set[tuple[int, int]] = set()
        for step in self.steps:
            directions: list[tuple[int, int]] = []
            if isinstance(step, FaultStep):
                directions = step.directions
            elif isinstance(step, PartitionStep):
                directions = partition_directions(step.groups)
            pairs |= {(min(a, b), max(a, b)) for a, b in directions}
        return pairs

    @property
    def fault_phase(self) -> tuple[float, float] | None:
        """``[start, end)`` seconds after t=0 that the floor is judged on: from the first step
        to the last, or to the end of the run when every step is at one moment."""
        if not self.steps:
            return None
        first, last = self.steps[0].at, self.steps[-1].at
        return (first, last if last > first else float("inf"))

    @property
    def recovery_from(self) -> float | None:
        """Recovery is timed from the last step: the one that ends the disruption."""
        return self.steps[-1].at if self.steps else None


def _step_nodes(step: object) -> list[int]:
    if isinstance(step, NodeStep | SlowStep):
        return [step.node]
    if isinstance(step, FaultStep):
        return [n for pair in step.directions for n in pair]
    if isinstance(step, ClearStep) and step.link:
        return [n for pair in parse_link(step.link) for n in pair]
    if isinstance(step, PartitionStep):
        return [n for group in step.groups for n in group]
    return []


def parse_scenario(text: str, source: str = "<scenario>") -> Scenario:
    """Parse TOML text into a :class:`Scenario`; :class:`ScenarioError` names the problem."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ScenarioError(f"{source}: not valid TOML: {exc}") from exc
    try:
        return Scenario.model_validate(data)
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        raise ScenarioError(f"{source}: {exc}") from exc


def load_scenario(path_or_name: str | Path) -> Scenario:
    """A path to a TOML file, or the name of one in ``lab/scenarios/`` (without ``.toml``)."""
    path = Path(path_or_name)
    if not path.exists():
        bundled = SCENARIO_DIR / f"{path_or_name}.toml"
        if not bundled.exists():
            names = ", ".join(sorted(p.stem for p in SCENARIO_DIR.glob("*.toml")))
            raise ScenarioError(f"no scenario {str(path_or_name)!r}; bundled: {names}")
        path = bundled
    return parse_scenario(path.read_text(), str(path))


SCENARIO_DIR = Path(__file__).resolve().parent / "scenarios"
