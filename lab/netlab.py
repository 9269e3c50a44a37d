"""The fault lab: run a scenario against N local nodes joined through chaos proxies.

    python lab/netlab.py SCENARIO [--out DIR] [--model NAME] [--seed N] [--keep]

SCENARIO is a TOML file or the name of one in ``lab/scenarios/``. The lab builds tiny models
(or uses ``--model``), starts node 0, joins the others with invites dialled through their
proxies, waits until every node lists every model, then runs the probe against
``probe.target`` while it plays the scenario's timeline (faults, SIGKILL/SIGSTOP/SIGCONT,
restarts, late joins). It prints a verdict table; nodes and proxies are always torn down.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import asyncio
import tempfile
import time
from dataclasses import dataclass, field

import httpx
import orjson
from rich.console import Console

from lab.actions import Timeline
from lab.links import LinkFabric, namespace_support
from lab.nodes import (
    NO_DIRECT_ADDRESS,
    LabError,
    LabNode,
    build_tiny_models,
    healthy,
    listed_models,
    mesh_up_flags,
    mint_invite,
    missing_up_flags,
    node_env,
    node_status,
    rewrite_invite,
    wait_until,
)
from lab.probe import ProbeConfig, Prober
from lab.procs import ProcessRegistry
from lab.report import RowWriter, verdict_table, write_summary
from lab.rows import ProbeRow
from lab.scenario import (
    Scenario,
    load_scenario,
)
from lab.stats import summarize
from lab.verdict import Verdict, judge


@dataclass
class LabOptions:
    out_dir: Path
    model: str | None = None  # a real model for every node instead of tiny ones
    seed: int | None = 1
    start_timeout_s: float = 240.0  # model load on a busy CPU is slow
    settle_timeout_s: float = 60.0  # after the run: time allowed to re-converge
    show: bool = True
    up_args: list[str] = field(default_factory=list)  # more `mesh up` flags for every node


@dataclass
class LabRun:
    """What a finished run leaves behind (also written under ``out_dir``)."""

    verdict: Verdict
    rows: list[ProbeRow]
    events: list[dict]
    leftovers: list[int] = field(default_factory=list)


class NetLab:
    """One scenario run: nodes, proxies, the probe and the timeline. Use ``async with``."""

    def __init__(self, scenario: Scenario, options: LabOptions, console: Console | None = None):
        self.scenario = scenario
        self.options = options
        self.console = console or Console(stderr=True, quiet=not options.show)
        self.registry = ProcessRegistry()
        self.nodes: list[LabNode] = []
        self.fabric: LinkFabric | None = None
        self.events: list[dict] = []
        self.flags: set[str] = set()
        self._client = httpx.AsyncClient(trust_env=False)
        self.timeline = Timeline(self)
        self._t0 = time.time()

    async def __aenter__(self) -> NetLab:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def event(self, what: str, **details: object) -> None:
        entry = {
            "t": time.time(),
            "rel_s": round(time.time() - self._t0, 3),
            "event": what,
            **details,
        }
        self.events.append(entry)
        self.console.log(f"[cyan]{what}[/] {' '.join(f'{k}={v}' for k, v in details.items())}")

    # ------------------------------------------------------------------ set-up

    async def _model_args(self) -> list[str]:
        """What each node serves: tiny models built once per name (same name → same weights)."""
        args: list[str] = []
        to_build: dict[str, Path] = {}
        for index, spec in enumerate(self.scenario.nodes):
            if not spec.serves:
                args.append("")
            elif self.options.model and spec.is_tiny:
                args.append(self.options.model)
            elif not spec.is_tiny:
                args.append(spec.model)
            else:
                path = self.options.out_dir / "models" / spec.model_id(index)
                if not (path / "config.json").exists():
                    to_build[str(path)] = path
                args.append(str(path))
        if to_build:
            await build_tiny_models(list(to_build.values()))
        return args

    async def setup(self) -> None:
        """Models, proxies, node 0, then every initial node joined and seeing every model."""
        self.registry.install_cleanup()
        self.flags = await asyncio.to_thread(mesh_up_flags)
        missing = missing_up_flags(self.flags)
        if missing:
            raise LabError(f"`mesh up` lacks the flags the lab needs: {', '.join(missing)}")
        ok, why = namespace_support()
        self.event(
            "network",
            method="chaos proxies",
            netns=("available" if ok else "unavailable"),
            why=why,
            advertise=NO_DIRECT_ADDRESS,
        )
        model_args = await self._model_args()
        for index, spec in enumerate(self.scenario.nodes):
            home = self.options.out_dir / f"node-{index}"
            home.mkdir(parents=True, exist_ok=True)
            self.nodes.append(
                LabNode(index=index, spec=spec, home=home, model_arg=model_args[index])
            )
        self.fabric = LinkFabric([n.mesh_port for n in self.nodes], seed=self.options.seed)
        await self.fabric.start()
        self.event(
            "proxies",
            count=len(self.fabric.proxies),
            ports=[proxy.port for proxy in self.fabric.proxies.values()],
        )
        first = self.nodes[0]
        await self.start_node(first, join_token=None)
        await wait_until(
            "node 0 healthy",
            lambda: healthy(self._client, first),
            self.options.start_timeout_s,
            first,
        )
        for node in self.nodes[1:]:
            if node.spec.start:
                await self.join(node, wait=True)
        await self.wait_converged()

    def probe_models(self) -> list[str] | None:
        """The scenario's probe models, with tiny ids mapped to what the nodes really serve
        (they differ under ``--model``)."""
        if self.scenario.probe.models is None:
            return None
        served = {n.spec.model_id(n.index): n.model_id for n in self.nodes if n.spec.serves}
        return list(dict.fromkeys(served.get(m, m) for m in self.scenario.probe.models))

    async def start_node(self, node: LabNode, join_token: str | None) -> None:
        assert self.fabric is not None
        argv = node.up_argv(
            peers=self.fabric.peers_of(node.index),
            join_token=join_token,
            flags=self.flags,
            extra=list(self.options.up_args),
        )
        node.process = self.registry.spawn(
            f"node-{node.index}", argv, log_path=node.log_path, env=node_env(node.home)
        )
        node.starts += 1
        self.event("start", node=node.index, pid=node.process.pid, join=bool(join_token))

    async def join(self, node: LabNode, *, wait: bool) -> None:
        """Invite from the first running node, dialled through this node's proxy towards it."""
        assert self.fabric is not None
        inviter = next((n for n in self.nodes if n.running() and n.index != node.index), None)
        if inviter is None:
            raise LabError(f"node {node.index} cannot join: no running node to invite it")
        token = rewrite_invite(
            await mint_invite(self._client, inviter), self.fabric.address(node.index, inviter.index)
        )
        await self.start_node(node, join_token=token)
        if wait:
            await wait_until(
                f"node {node.index} healthy",
                lambda: healthy(self._client, node),
                self.options.start_timeout_s,
                node,
            )

    def running_nodes(self) -> list[LabNode]:
        return [n for n in self.nodes if n.running()]

    async def wait_converged(self, timeout_s: float | None = None) -> None:
        """Until every running node lists the models of every running node."""
        running = self.running_nodes()
        expected = {n.model_id for n in running if n.spec.serves}

        async def converged() -> bool:
            listed = [await listed_models(self._client, n) for n in running]
            return all(expected <= models for models in listed)

        await wait_until(
            f"every node to list {sorted(expected)}",
            converged,
            timeout_s or self.options.start_timeout_s,
        )
        self.registry.note_descendants()
        self.event("converged", models=",".join(sorted(expected)))

    async def bypassed_links(self, window_s: float = 4.0) -> list[tuple[int, int]]:
        """Connected node pairs whose proxies carried nothing for ``window_s`` (> 2 pings).

        The tunnel pings every 1.5 s, so a live link through the lab's proxies always moves
        datagrams; a connected pair with none dialled around them (e.g. a member's advertised
        address) and its faults were never applied.
        """
        assert self.fabric is not None
        ids: dict[str, int] = {}
        connected: set[tuple[int, int]] = set()
        statuses = {}
        for node in self.running_nodes():
            statuses[node.index] = await node_status(self._client, node)
            node_id = (statuses[node.index].get("node") or {}).get("node_id")
            if node_id:
                ids[str(node_id)] = node.index
        for index, status in statuses.items():
            for peer in status.get("peers") or []:
                other = ids.get(str(peer.get("node_id")))
                if peer.get("connected") and other is not None:
                    connected.add((min(index, other), max(index, other)))
        if not connected:
            return []
        before = {pair: self.fabric.datagrams(*pair) for pair in connected}
        await asyncio.sleep(window_s)
        return sorted(pair for pair in connected if self.fabric.datagrams(*pair) == before[pair])

    # ------------------------------------------------------------------ run and tear down

    async def run(self) -> LabRun:
        out = self.options.out_dir
        await self.setup()
        probe = self.scenario.probe
        target = self.nodes[probe.target]
        config = ProbeConfig(
            urls=[target.url],
            models=self.probe_models(),
            apis=list(probe.apis),
            interval_s=probe.interval_s,
            timeout_s=probe.timeout_s,
            max_tokens=probe.max_tokens,
            sentinel=probe.sentinel,
            include_mesh=probe.include_mesh,
            show_progress=False,
        )
        writer = RowWriter(out / "rows.jsonl")

        def on_row(row: ProbeRow) -> None:
            writer.write(row)
            if not row.ok:
                self.console.log(
                    f"[yellow]{row.outcome.value}[/] {row.model}/{row.api}: {row.error}"
                )

        prober = Prober(config, on_row=on_row)
        stop = asyncio.Event()
        started_at = time.time()
        self.event("probe-start", target=target.url)
        probe_task = asyncio.create_task(prober.run(stop))
        try:
            await self.timeline.play(started_at)
        finally:
            stop.set()
            # In-flight requests finish within their own hard deadline.
            await asyncio.wait_for(probe_task, probe.timeout_s + 10)
            writer.close()
        self.event("probe-end", rows=len(prober.rows))
        verdict = judge(self.scenario, prober.rows, started_at)
        try:  # every running node must see every running node's model again
            await self.wait_converged(self.options.settle_timeout_s)
        except LabError as exc:
            self.event("not-converged", error=str(exc).splitlines()[0])
            verdict = _fail(
                verdict, f"the mesh did not re-converge within {self.options.settle_timeout_s:g}s"
            )
        bypassed = await self.bypassed_links()
        if bypassed:
            self.event("bypassed", links=", ".join(f"{a}<->{b}" for a, b in bypassed))
        voided = [pair for pair in bypassed if pair in self.scenario.faulted_pairs()]
        if voided:
            links = ", ".join(f"{a}<->{b}" for a, b in voided)
            verdict = _fail(
                verdict, f"links {links} bypassed the chaos proxies: their faults were not applied"
            )
        write_summary(out, summarize(prober.rows), prober.rows)
        return LabRun(verdict=verdict, rows=prober.rows, events=self.events)

    async def close(self) -> None:
        await self.timeline.stop_slowing()
        await asyncio.to_thread(self.registry.close)
        if self.fabric is not None:
            (self.options.out_dir / "links.json").write_bytes(
                orjson.dumps(self.fabric.stats(), option=orjson.OPT_INDENT_2)
            )
            await self.fabric.close()
        await self._client.aclose()
        self.registry.uninstall_cleanup()


def _fail(verdict: Verdict, reason: str) -> Verdict:
    return verdict.model_copy(update={"passed": False, "reasons": [*verdict.reasons, reason]})


async def run_scenario(
    scenario: Scenario, options: LabOptions, console: Console | None = None
) -> LabRun:
    """Run one scenario end to end; always tears everything down. Writes verdict.json too."""
    options.out_dir.mkdir(parents=True, exist_ok=True)
    lab = NetLab(scenario, options, console)
    try:
        result = await lab.run()
    finally:
        await lab.close()
        (options.out_dir / "events.jsonl").write_bytes(
            b"".join(orjson.dumps(e) + b"\n" for e in lab.events)
        )
    result.leftovers = lab.registry.leftovers()
    (options.out_dir / "verdict.json").write_bytes(
        orjson.dumps(
            {**result.verdict.model_dump(mode="json"), "leftover_pids": result.leftovers},
            option=orjson.OPT_INDENT_2,
        )
    )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("scenario", help="TOML file, or a name in lab/scenarios/")
    parser.add_argument("--out", type=Path, help="output directory (default: a new temp dir)")
    parser.add_argument("--model", help="serve this real model on every tiny node instead")
    parser.add_argument("--seed", type=int, default=1, help="chaos proxies' RNG seed")
    args = parser.parse_args(argv)
    return run_scenario_cli(args.scenario, out_dir=args.out, model=args.model, seed=args.seed)


def run_scenario_cli(
    name: str, *, out_dir: Path | None, model: str | None, seed: int | None
) -> int:
    """Exit status: 0 pass, 1 fail, 2 the lab itself could not run, 130 interrupted."""
    console = Console(stderr=True)
    try:
        scenario = load_scenario(name)
    except ValueError as exc:
        console.print(f"[bold red]error:[/] {exc}")
        return 2
    out = out_dir or Path(tempfile.mkdtemp(prefix=f"mesh-lab-{scenario.name}-"))
    console.print(f"scenario [bold]{scenario.name}[/]: {scenario.description} → {out}")
    try:
        result = asyncio.run(
            run_scenario(scenario, LabOptions(out_dir=out, model=model, seed=seed), console)
        )
    except KeyboardInterrupt:
        console.print("interrupted: nodes and proxies were torn down")
        return 130
    except LabError as exc:
        console.print(f"[bold red]lab error:[/] {exc}")
        return 2
    Console().print(verdict_table(result.verdict))
    if result.leftovers:
        console.print(f"[red]processes left behind: {result.leftovers}[/]")
    console.print(f"rows, summary, plots, events and logs in {out}")
    return 0 if result.verdict.passed and not result.leftovers else 1


if __name__ == "__main__":
    sys.exit(main())
