"""Benchmark ``model="mesh"``: TTFT against the fastest single worker and a buffered baseline, and
answer quality of each MoA policy against each single worker (with confidence intervals and the
oracle), on reasoning-gym items with exact-match scoring.

Part 1 (unless ``--no-ttft``): scripted workers with realistic, jittered prefill and decode
speeds; with ``--model DIR`` (repeatable) also live TTFT of real MLX workers. → ``moa.md``.
Part 2 (``--model DIR`` and ``--items N > 0``; needs ``pip install -e '.[bench]'`` for
reasoning-gym): real MLX workers over HTTP. Each item's candidate streams are run live once
(exactly the calls ``mesh`` makes, concurrently) and recorded with their timings; every policy
then decides over a replay of those same streams, and the reduce policy's aggregator call runs
live on the real strongest model. So policies are compared on identical candidates at a fraction
of the cost. Every item is appended to an item log; rerunning the same command resumes there
(``--time-budget-s`` stops early and still writes the report). → ``moa-quality-policies.md``.

    python bench/moa.py                                   # part 1, scripted only
    python bench/moa.py --model M1 --model M2 --items 0   # part 1 with real-model TTFT
    python bench/moa.py --no-ttft --model M1 --model M2 --items 300
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import math
import random
import re
import statistics
import sys
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gateway.events import Done, Event, TextDelta, event_to_dict, is_terminal
from gateway.moa import MixtureOfAgents, MoaConfig
from gateway.moa.candidates import plan_candidates
from gateway.request import ChatRequest, Message
from gateway.testing import ScriptedUpstream, Sleep, Step
from gateway.upstream import ModelInfo, StaticDirectory, Upstream

# name: (median time to first token incl. prefill, median seconds per token). Roughly a 1B, a
# 4B and an 8B model on one Apple-silicon machine each, for a ~1k-token prompt.
# The policies this benchmark compares (vote and auto: bench/moa_quality.py).
POLICIES = ("race", "consensus", "reduce")
PROFILES = {"small": (0.25, 0.012), "mid": (0.45, 0.025), "large": (0.90, 0.050)}
PARAMS = {"small": 1_000, "mid": 4_000, "large": 8_000}
ANSWER_TOKENS = 48


def _ask(text: str, **fields) -> ChatRequest:
    return ChatRequest(model="mesh", messages=[Message(role="user", content=text)], **fields)


async def _ttft(stream: AsyncIterator[Event]) -> tuple[float, str, bool]:
    """Seconds to the first text delta, the full text, and whether it ended with Done."""
    start, first, parts, ok = time.monotonic(), math.nan, [], False
    async for event in stream:
        if isinstance(event, TextDelta):
            if math.isnan(first):
                first = time.monotonic() - start
            parts.append(event.text)
        if is_terminal(event):
            ok = isinstance(event, Done)
            if not ok:
                print(f"  stream failed: {event}", file=sys.stderr, flush=True)
    return first, "".join(parts), ok


# -- part 1: TTFT with scripted workers ---------------------------------------------------------


def _scripted_request(rng: random.Random) -> dict[str, list[Step]]:
    """One request's worth of worker scripts: jittered prefill, decode pace and a rare stall."""
    scripts = {}
    for name, (ttft, tpot) in PROFILES.items():
        first = ttft * rng.lognormvariate(0, 0.3) * (6 if rng.random() < 0.05 else 1)
        pace = tpot * rng.lognormvariate(0, 0.15)
        steps: list[Step] = [Sleep(first)]
        for i in range(ANSWER_TOKENS):
            steps += [TextDelta(f"{name}{i} "), Sleep(pace)]
        scripts[name] = [*steps, Done()]
    return scripts


def _directory(scripts: dict[str, list[Step]]) -> StaticDirectory:
    directory = StaticDirectory()
    for name, steps in scripts.items():
        directory.add(ModelInfo(name, parameters=PARAMS[name]), ScriptedUpstream.of(*steps))
    return directory


async def _buffered(scripts: dict[str, list[Step]]) -> float:
    """Wait for every worker to finish, then send: TTFT is the last worker's finish time."""
    start = time.monotonic()
    streams = [ScriptedUpstream.of(*s).stream(_ask("q")) for s in scripts.values()]
    await asyncio.gather(*(_ttft(s) for s in streams))
    return time.monotonic() - start


async def bench_ttft(requests: int, seed: int) -> list[tuple[str, list[float]]]:
    rng = random.Random(seed)
    batches = [_scripted_request(rng) for _ in range(requests)]
    modes: list[tuple[str, object]] = [(f"single {n}", n) for n in PROFILES]
    modes += [("buffered (all, then send)", "buffered")]
    modes += [("mesh race (default: N=4, early commit)", ("race", 4, True))]
    modes += [(f"mesh race N={n}, no early commit", ("race", n, False)) for n in (1, 2, 4, 8)]
    modes += [("mesh consensus", ("consensus", 4, True)), ("mesh reduce", ("reduce", 4, True))]
    rows = []
    gate = asyncio.Semaphore(6)  # few at a time: timings of many concurrent loops would blur
    for label, mode in modes:

        async def one(scripts: dict[str, list[Step]], mode=mode) -> float:
            if mode == "buffered":
                return await _buffered(scripts)
            if isinstance(mode, str):
                return (await _ttft(ScriptedUpstream.of(*scripts[mode]).stream(_ask("q"))))[0]
            policy, n, early = mode
            config = MoaConfig(policy=policy, race_min_tokens=n, race_early_commit=early)
            moa = MixtureOfAgents(_directory(scripts), config)
            return (await _ttft(moa.stream(_ask("q"))))[0]

        async def limited(scripts: dict[str, list[Step]], one=one, gate=gate) -> float:
            async with gate:
                return await one(scripts)

        rows.append((label, list(await asyncio.gather(*(limited(b) for b in batches)))))
    return rows


def _pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def ttft_table(rows: list[tuple[str, list[float]]]) -> tuple[list[str], dict[str, float]]:
    medians = {label: statistics.median(v) for label, v in rows}
    fastest = min((m, label) for label, m in medians.items() if label.startswith("single"))
    buffered = medians["buffered (all, then send)"]
    lines = [
        "| mode | median TTFT (ms) | p90 (ms) | × fastest single | vs buffered |",
        "|---|---:|---:|---:|---:|",
    ]
    for label, values in rows:
        m = medians[label]
        lines.append(
            f"| {label} | {m * 1000:.0f} | {_pct(values, 0.9) * 1000:.0f} | "
            f"{m / fastest[0]:.2f} | {100 * (1 - m / buffered):+.0f} % |"
        )
    return lines, {"fastest": fastest[0], "buffered": buffered, **medians}


# -- part 2: quality with real models ----------------------------------------------------------

# label: (reasoning-gym generator, its config). Easy settings: the models at hand have 135M-270M
# parameters, and on harder items every mode scores ~0, which compares nothing.
TASKS: dict[str, tuple[str, dict]] = {
    "add_sub_1digit": (
        "basic_arithmetic",
        {
            "min_terms": 2,
            "max_terms": 2,
            "min_digits": 1,
            "max_digits": 1,
            "operators": ["+", "-"],
            "allow_parentheses": False,
            "allow_negation": False,
        },
    ),
    "add_sub_2digit": (
        "basic_arithmetic",
        {
            "min_terms": 2,
            "max_terms": 2,
            "min_digits": 2,
            "max_digits": 2,
            "operators": ["+", "-"],
            "allow_parentheses": False,
            "allow_negation": False,
        },
    ),
    "leg_counting": ("leg_counting", {"min_animals": 1, "max_animals": 1, "max_instances": 3}),
}
TASK_NOTES = {
    "add_sub_1digit": "`basic_arithmetic`, a + b or a - b with one-digit numbers",
    "add_sub_2digit": "`basic_arithmetic`, the same with two-digit numbers",
    "leg_counting": "`leg_counting`, up to 3 animals of one kind",
}
_INT = re.compile(r"-?\d+")


def make_items(count: int, seed: int) -> list[tuple[str, str, str]]:
    """(task label, question, answer) triples, alternating over TASKS, from fixed seeds."""
    import reasoning_gym  # optional: pip install 'mlx-mesh[bench]'

    per_task = math.ceil(count / len(TASKS))
    pools = [
        [
            (label, e["question"], str(e["answer"]))
            for e in reasoning_gym.create_dataset(name, size=per_task, seed=seed, **cfg)
        ]
        for label, (name, cfg) in TASKS.items()
    ]
    return [pool[i] for i in range(per_task) for pool in pools][:count]


def is_correct(text: str, answer: str, question: str = "") -> bool:
    """Exact match on the last integer of the reply (the items have integer answers; small
    models restate the question before answering, as in GSM8K-style scoring), once echoes of the
    question are removed: a base model that parrots "Calculate 0 + 7." has not answered 7."""
    for line in question.splitlines():
        echo = line.strip().rstrip(".?!")
        if len(echo) >= 8:
            text = text.replace(echo, " ")
    found = _INT.findall(text.replace(",", ""))
    return bool(found) and found[-1] == answer.strip()


def rescore(done: list[dict], items: list[tuple[str, str, str]]) -> list[dict]:
    """Score the logged replies again with the current rule (logs keep the raw texts)."""
    out = []
    for row in done:
        _, question, answer = items[row["item"]]
        outcome = {}
        for label, (_, first) in row["outcome"].items():
            if label.startswith("oracle"):
                texts = [
                    "".join(e.get("text", "") for _, e in steps if e.get("t") == "text")
                    for steps in row.get("recordings", {}).values()
                ]
                hit = any(is_correct(t, answer, question) for t in texts)
            else:
                hit = is_correct(row["texts"][label], answer, question)
            outcome[label] = (hit, first)
        out.append({**row, "outcome": outcome})
    return out


@dataclasses.dataclass
class Recording:
    """One candidate's live stream: (seconds since the previous event, event)."""

    steps: list[tuple[float, Event]]

    def script(self) -> list[Step]:
        out: list[Step] = []
        for gap, event in self.steps:
            out += [Sleep(gap), event]
        return out

    @property
    def text(self) -> str:
        return "".join(e.text for _, e in self.steps if isinstance(e, TextDelta))

    @property
    def ttft(self) -> float:
        elapsed = 0.0
        for gap, event in self.steps:
            elapsed += gap
            if isinstance(event, TextDelta):
                return elapsed
        return math.nan

    @property
    def total(self) -> float:
        return sum(gap for gap, _ in self.steps)


async def record(upstream: Upstream, request: ChatRequest) -> Recording:
    steps, last = [], time.monotonic()
    async for event in upstream.stream(request):
        now = time.monotonic()
        steps.append((now - last, event))
        last = now
    return Recording(steps)


class ReplayThenLive(Upstream):
    """Replays recorded streams for the first calls, then serves later calls (the aggregator)
    live from the real worker."""

    def __init__(self, recordings: list[Recording], live: Upstream) -> None:
        self.name = live.name
        self._replays = [ScriptedUpstream.of(*r.script()) for r in recordings]
        self._live = live
        self._calls = 0

    def stream(self, request: ChatRequest) -> AsyncIterator[Event]:
        call, self._calls = self._calls, self._calls + 1
        source = self._replays[call] if call < len(self._replays) else self._live
        return source.stream(request)


# -- part 3: TTFT with real models -------------------------------------------------------------

TOPICS = [
    "why the sky is blue",
    "how a bicycle stays upright",
    "what a compiler does",
    "why bread rises",
    "how bees make honey",
    "what causes the seasons",
    "how a refrigerator keeps food cold",
    "why leaves change colour in autumn",
    "how a rainbow forms",
    "what a database index is",
    "why the moon has phases",
    "how vaccines work",
]


async def _first_delta(stream: AsyncIterator[Event]) -> float:
    """Seconds to the first text delta; then the stream is closed (which cancels the work)."""
    start = time.monotonic()
    try:
        async for event in stream:
            if isinstance(event, TextDelta):
                return time.monotonic() - start
            if is_terminal(event):
                break
        return math.nan
    finally:
        await stream.aclose()  # type: ignore[attr-defined]


async def bench_real_ttft(
    model_dirs: list[Path], requests: int, max_tokens: int
) -> list[tuple[str, list[float]]]:
    """Live TTFT of each single worker, of ``mesh`` (default policy) and of the buffered
    baseline (every candidate runs to the end, then the answer is sent), one request at a time."""
    times: dict[str, list[float]] = {}
    with live_workers(model_dirs) as live:
        config = MoaConfig(first_token_timeout_s=600, total_timeout_s=1800)
        await _first_delta(live.routes(model_dirs[0].name)[0].upstream.stream(_ask("Hi")))
        for i in range(requests):
            topic = TOPICS[i % len(TOPICS)]

            def cold(mode: int, topic: str = topic, i: int = i) -> ChatRequest:
                """The request, opening with a system line of its own: no mode may reuse the
                prompt cache another mode's run of the same question left behind."""
                system = Message(role="system", content=f"Conversation {i}.{mode}.")
                ask = Message(role="user", content=f"In a few sentences, explain {topic}.")
                return ChatRequest(
                    model="mesh",
                    messages=[system, ask],
                    max_tokens=max_tokens,
                    temperature=0.0,
                )

            modes: dict[str, AsyncIterator[Event]] = {}
            for mode, path in enumerate(model_dirs):
                route = live.routes(path.name)[0]
                modes[f"single {path.name}"] = route.upstream.stream(
                    cold(mode).model_copy(update={"model": path.name})
                )
            modes["mesh race (default)"] = MixtureOfAgents(live, config).stream(cold(-1))
            for label, stream in modes.items():
                times.setdefault(label, []).append(await _first_delta(stream))
                await asyncio.sleep(0.5)  # let cancelled work stop before the next measurement
            start = time.monotonic()
            request = cold(-2)
            candidates = plan_candidates(live, request, config)
            await asyncio.gather(*(record(c.upstream, c.request) for c in candidates))
            times.setdefault("buffered (all, then send)", []).append(time.monotonic() - start)
            print(
                f"real TTFT {i + 1}/{requests}: "
                + ", ".join(f"{k}={v[-1]:.2f}s" for k, v in times.items()),
                flush=True,
            )
    return list(times.items())


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return (0.0, 0.0)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def load_item_log(path: Path, header: dict) -> list[dict]:
    """The items already run with these settings (a run interrupted by a session limit resumes
    where it stopped). A log written with other settings is an error, not silently mixed in."""
    if not path.exists():
        return []
    lines = [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]
    if not lines:
        return []
    if lines[0] != {"header": orjson.loads(orjson.dumps(header))}:
        raise SystemExit(
            f"{path} was written with other settings ({lines[0]}); pass another --item-log "
            "or delete it to start over"
        )
    return lines[1:]


def append_line(path: Path, row: dict, *, fresh: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb" if fresh else "ab") as log:
        log.write(orjson.dumps(row) + b"\n")


def tally(done: list[dict]) -> tuple[dict[str, int], dict[str, list[float]]]:
    correct: dict[str, int] = {}
    ttfts: dict[str, list[float]] = {}
    for row in done:
        for label, (hit, first) in row["outcome"].items():
            correct[label] = correct.get(label, 0) + hit
            ttfts.setdefault(label, []).append(math.nan if first is None else first)
    return correct, ttfts


@contextlib.contextmanager
def live_workers(model_dirs: list[Path]) -> Iterator[StaticDirectory]:
    """Real MLX workers over HTTP on loopback, one per model directory, in a directory."""
    from gateway.worker_client import WorkerClient
    from worker.testing import run_worker_in_thread

    live = StaticDirectory()
    with contextlib.ExitStack() as workers:
        for path in model_dirs:
            url, _ = workers.enter_context(run_worker_in_thread(path, name=path.name))
            size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
            upstream = WorkerClient(url.removesuffix("/v1"), path.name)
            live.add(ModelInfo(path.name, parameters=size), upstream)
        yield live


async def bench_quality(
    model_dirs: list[Path],
    items: int,
    max_tokens: int,
    seed: int,
    item_log: Path,
    time_budget_s: float = math.inf,
) -> list[dict]:
    started = time.monotonic()
    header = {
        "models": [p.name for p in model_dirs],
        "tasks": TASKS,
        "seed": seed,
        "max_tokens": max_tokens,
    }
    done = load_item_log(item_log, header)
    if len(done) >= items or time_budget_s <= 0:
        return done[:items]  # nothing to run: report what the log holds
    if not done:
        append_line(item_log, {"header": header}, fresh=True)
    with live_workers(model_dirs) as live:
        # Default policy settings; deadlines sized for slow CPUs (a 135M model decodes at a few
        # tokens/s on a shared Linux CPU, and three samples share it).
        config = MoaConfig(first_token_timeout_s=600, total_timeout_s=1800)
        await record(live.routes(model_dirs[0].name)[0].upstream, _ask("Hi", max_tokens=2))
        for index, (task, question, answer) in enumerate(make_items(items, seed)):
            if index < len(done):
                continue
            if time.monotonic() - started > time_budget_s:
                print(f"time budget spent after {len(done)} items", flush=True)
                break
            request = _ask(
                f"{question}\nReply with only the final number.",
                max_tokens=max_tokens,
                temperature=0.0,
                seed=seed,
            )
            candidates = plan_candidates(live, request, config)
            recordings = await asyncio.gather(*(record(c.upstream, c.request) for c in candidates))
            outcome = {}
            for c, rec in zip(candidates, recordings, strict=True):
                if c.name.endswith("#0") or "#" not in c.name:
                    outcome[f"single {c.model.id}"] = (rec.text, rec.ttft)
            outcome["oracle (any candidate)"] = (
                next((r.text for r in recordings if is_correct(r.text, answer, question)), ""),
                math.nan,
            )
            outcome["buffered (all, then send)"] = (
                recordings[0].text,
                max(r.total for r in recordings),
            )

            async def decide(policy, candidates=candidates, recordings=recordings, request=request):
                replay = StaticDirectory()
                for model in {c.model.id: c.model for c in candidates}.values():
                    mine = [
                        r
                        for c, r in zip(candidates, recordings, strict=True)
                        if c.model.id == model.id
                    ]
                    replay.add(model, ReplayThenLive(mine, live.routes(model.id)[0].upstream))
                moa = MixtureOfAgents(replay, dataclasses.replace(config, policy=policy))
                first, text, _ = await _ttft(moa.stream(request))
                return text, first

            # The policies replay side by side (only reduce's aggregator call uses the model).
            decided = await asyncio.gather(*(decide(p) for p in POLICIES))
            for policy, result in zip(POLICIES, decided, strict=True):
                outcome[f"mesh {policy}"] = result
            row = {
                "item": index,
                "task": task,
                "answer": answer,
                "outcome": {
                    label: (
                        is_correct(text, answer, question),
                        None if math.isnan(first) else first,
                    )
                    for label, (text, first) in outcome.items()
                },
                "texts": {label: text for label, (text, _) in outcome.items()},
                # The raw candidate streams, so a changed arbiter can be replayed offline.
                "recordings": {
                    c.name: [[gap, event_to_dict(event)] for gap, event in rec.steps]
                    for c, rec in zip(candidates, recordings, strict=True)
                },
            }
            append_line(item_log, row)
            done.append(row)
            print(
                f"item {index + 1}/{items}: answer {answer}: "
                + ", ".join(f"{k}={v[0].strip()[:12]!r}" for k, v in outcome.items()),
                flush=True,
            )
        return done[:items]


def quality_table(correct: dict[str, int], ttfts: dict[str, list[float]], n: int) -> list[str]:
    lines = [
        "| mode | exact match | 95 % CI (Wilson) | median TTFT (ms) |",
        "|---|---:|---:|---:|",
    ]
    for label, hits in correct.items():
        low, high = wilson(hits, n)
        times = [t for t in ttfts[label] if not math.isnan(t)]
        ttft = f"{statistics.median(times) * 1000:.0f}" if times else "–"
        lines.append(
            f"| {label} | {hits}/{n} ({100 * hits / n:.0f} %) | {100 * low:.0f}–{100 * high:.0f} % | {ttft} |"
        )
    return [*lines, "", *quality_verdict(correct, ttfts)]


def sign_test_p(wins: int, losses: int) -> float:
    """Two-sided exact sign test (McNemar on the discordant items): the chance of a split at
    least this uneven if neither mode were better."""
    n = wins + losses
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(wins, losses) + 1)) / 2**n
    return min(1.0, 2 * tail)


def paired_table(done: list[dict]) -> list[str]:
    """Each mesh policy against the best single worker on the same items: the CIs of two
    accuracies overlap long before a paired difference stops being significant."""
    if not done:
        return []
    labels = list(done[0]["outcome"])
    singles = [label for label in labels if label.startswith("single ")]
    best = max(singles, key=lambda label: sum(r["outcome"][label][0] for r in done))
    lines = [
        f"Paired against the best single worker ({best}), item by item:",
        "",
        "| mode | right where it was wrong | wrong where it was right | sign test p |",
        "|---|---:|---:|---:|",
    ]
    for label in (x for x in labels if x.startswith("mesh ")):
        wins = sum(r["outcome"][label][0] and not r["outcome"][best][0] for r in done)
        losses = sum(r["outcome"][best][0] and not r["outcome"][label][0] for r in done)
        lines.append(f"| {label} | {wins} | {losses} | {sign_test_p(wins, losses):.3f} |")
    return lines


def per_task_table(done: list[dict]) -> list[str]:
    labels = list(done[0]["outcome"]) if done else []
    lines = ["| task | n | " + " | ".join(labels) + " |", "|---|---:|" + "---:|" * len(labels)]
    for task in TASKS:
        rows = [r for r in done if r.get("task") == task]
        if rows:
            hits = [sum(r["outcome"][label][0] for r in rows) for label in labels]
            lines.append(f"| {task} | {len(rows)} | " + " | ".join(map(str, hits)) + " |")
    return lines


def quality_verdict(correct: dict[str, int], ttfts: dict[str, list[float]]) -> list[str]:
    """The issue's targets, stated for this run: mesh ≥ the best single worker, and TTFT."""

    def median_ms(label: str) -> float:
        times = [t for t in ttfts.get(label, []) if not math.isnan(t)]
        return statistics.median(times) * 1000 if times else math.nan

    singles = [label for label in correct if label.startswith("single ")]
    if not singles or "mesh race" not in correct:
        return []
    best = max(singles, key=lambda label: correct[label])
    fastest = min(singles, key=median_ms)
    race = median_ms("mesh race")
    met = correct["mesh race"] >= correct[best]
    below = 1 - race / median_ms("buffered (all, then send)")
    return [
        f"Default `race` vs the best single worker ({best}): {correct['mesh race']} vs "
        f"{correct[best]} correct – target mesh ≥ best single **{'met' if met else 'NOT met'}** "
        f"(a tie is within the CI). TTFT {race / median_ms(fastest):.2f} × the fastest single "
        f"worker and {100 * below:.0f} % below buffered here; with replies this short, waiting "
        "for every worker costs little, so the TTFT targets are measured with longer answers in "
        "[moa.md](moa.md)."
    ]


# -- report --------------------------------------------------------------------------------------

WHY_DEFAULT = """\
**Why `race` is the default.** `mesh` exists to answer about as fast as the fastest worker while
guarding against the cheap failures of small models (leaked `<think>` markup, repetition loops,
refusals, empty replies) and against a slow or dead worker. `race` is the only policy that meets
the latency target: it commits to the first worker whose opening passes the gates – at once when
the opening is conclusive ("The…"), after N=4 deltas when it might still turn into a refusal
("I…") – so its TTFT is the fastest worker's, and its median and tail are often *better* than the
fastest single worker's, because it takes the best of several jittered prefills and skips a
stalled one. `consensus` and `reduce` must wait for agreement, complete answers or the grace
period, which puts their TTFT within a few tens of percent of the buffered baseline. In the
300-item quality run ([moa-quality-policies.md](moa-quality-policies.md)) neither bought accuracy over `race`: with
the models at hand the oracle (any candidate right) equals the best single worker, so there was
nothing to gain, and `race` lost nothing. Callers who prefer quality over latency choose the
others per request with `metadata.moa_policy`; a person with bigger models should rerun the
quality part and revisit this choice."""


RESULTS = Path(__file__).parent / "results"


def real_ttft_section(args: argparse.Namespace) -> list[str]:
    if not args.model or not args.real_requests:
        return ["## TTFT with real models", "", "Not run: pass `--model DIR` (repeatable).", ""]
    rows = asyncio.run(bench_real_ttft(args.model, args.real_requests, args.real_max_tokens))
    table, medians = ttft_table(rows)
    race = medians["mesh race (default)"]
    below = 1 - race / medians["buffered"]
    return [
        "## TTFT with real models",
        "",
        f"Models: {', '.join(p.name for p in args.model)}, served by real MLX workers over HTTP "
        f"on this machine's CPU. {args.real_requests} requests, one at a time, each asking for a "
        f"few sentences (`max_tokens={args.real_max_tokens}`, greedy), each mode's copy opening "
        "with a system line of its own, so none reuses another's prompt cache. Singles run alone; "
        "`mesh` and the buffered baseline run every candidate at once on the same CPU, so each "
        "candidate is slower than it is alone – on a real mesh they run on different machines.",
        "",
        *table,
        "",
        f"Targets (default `race`): median ≤ 1.25 × fastest single worker – "
        f"**{race / medians['fastest']:.2f} ×** "
        f"({'met' if race <= 1.25 * medians['fastest'] else 'missed'}); "
        f"≥ 80 % below buffered – **{100 * below:.0f} % below** "
        f"({'met' if below >= 0.8 else 'missed'}).",
        "",
    ]


def ttft_report(args: argparse.Namespace) -> list[str]:
    requests, seed = args.requests, args.seed
    rows = asyncio.run(bench_ttft(requests, seed))
    table, medians = ttft_table(rows)
    race = medians["mesh race (default: N=4, early commit)"]
    return [
        '# `model="mesh"`: TTFT',
        "",
        f"Produced by `python bench/moa.py` ({time.strftime('%Y-%m-%d')}). Answer quality per "
        "policy against each single worker: [moa-quality-policies.md](moa-quality-policies.md) (two models) "
        "and [moa-quality-self.md](moa-quality-self.md) (one model, self-mixture).",
        "",
        "## TTFT with scripted workers",
        "",
        f"{requests} requests; three workers with jittered prefill and decode speeds "
        f"(median TTFT / per-token: "
        + ", ".join(f"{n} {t * 1000:.0f} ms / {p * 1000:.0f} ms" for n, (t, p) in PROFILES.items())
        + f"; 5 % of calls stall 6× in prefill), {ANSWER_TOKENS}-token answers. Default config "
        "except N. TTFT = time to the first text delta the client receives.",
        "",
        *table,
        "",
        f"Targets (default `race`): median ≤ 1.25 × fastest single worker – "
        f"**{race / medians['fastest']:.2f} ×** "
        f"({'met' if race <= 1.25 * medians['fastest'] else 'missed'}); "
        f"≥ 80 % below buffered – **{100 * (1 - race / medians['buffered']):.0f} % below** "
        f"({'met' if race <= 0.2 * medians['buffered'] else 'missed'}).",
        "",
        *real_ttft_section(args),
        "## Default policy",
        "",
        WHY_DEFAULT,
        "",
    ]


def quality_report(args: argparse.Namespace) -> list[str]:
    done = asyncio.run(
        bench_quality(
            args.model, args.items, args.max_tokens, args.seed, args.item_log, args.time_budget_s
        )
    )
    done = rescore(done, make_items(args.items, args.seed))
    correct, ttfts = tally(done)
    partial = (
        f" **Partial run: {len(done)} of {args.items} items so far**; rerun the same command to "
        "resume from the item log."
        if len(done) < args.items
        else ""
    )
    tasks = "; ".join(f"{label} ({TASK_NOTES[label]})" for label in TASKS)
    mixture = (
        " (one model: self-mixture of 3 samples at temperatures 0, 0.7, 1.0)"
        if len(args.model) == 1
        else ""
    )
    return [
        '# `model="mesh"`: answer quality on reasoning-gym (real models)',
        "",
        f"Produced by `python bench/moa.py --no-ttft --items {args.items} "
        + " ".join(f"--model {p.name}" for p in args.model)
        + (
            f" --quality-out {args.quality_out} --item-log {args.item_log.name}"
            if args.quality_out != "moa-quality-policies.md"
            else ""
        )
        + f"` ({time.strftime('%Y-%m-%d')}).",
        "",
        f"Models: {', '.join(p.name for p in args.model)}{mixture}. {len(done)} items, "
        f"alternating over the tasks {tasks}; seed {args.seed}. Greedy caller, "
        f"`max_tokens={args.max_tokens}`, thinking off, exact match on the last integer of the "
        "reply once echoes of the question are removed. Candidates run live once per item; "
        "each policy decides over a replay of the same streams (its aggregator call runs "
        "live). TTFTs are under concurrent load on a shared CPU, so compare them within this "
        "table only; the buffered row is there for its TTFT (its text is simply the first "
        "candidate's). Per-item replies: "
        f"[`{args.item_log.name}`]({args.item_log.name}).{partial}",
        "",
        *quality_table(correct, ttfts, len(done)),
        "",
        *paired_table(done),
        "",
        "Per task (exact match):",
        "",
        *per_task_table(done),
        "",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=60, help="scripted requests per mode")
    parser.add_argument("--no-ttft", action="store_true", help="skip part 1 (scripted TTFT)")
    parser.add_argument("--model", type=Path, action="append", default=[], help="MLX model dir")
    parser.add_argument("--items", type=int, default=300, help="reasoning-gym items (part 2)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--real-requests", type=int, default=12, help="real-model TTFT requests")
    parser.add_argument("--real-max-tokens", type=int, default=64)
    parser.add_argument("--results", type=Path, default=RESULTS, help="where the reports go")
    parser.add_argument(
        "--quality-out", default="moa-quality-policies.md", help="part 2 report name, in --results"
    )
    parser.add_argument(
        "--item-log",
        type=Path,
        default=RESULTS / "moa-items.jsonl",
        help="per-item results; a rerun with the same settings resumes from it",
    )
    parser.add_argument(
        "--time-budget-s",
        type=float,
        default=math.inf,
        help="start no new item after this many seconds, then write the (partial) report",
    )
    args = parser.parse_args()
    args.results.mkdir(parents=True, exist_ok=True)
    if not args.no_ttft:
        report = ttft_report(args)
        (args.results / "moa.md").write_text("\n".join(report))
        print("\n".join(report))
    if args.model and args.items:
        report = quality_report(args)
        (args.results / args.quality_out).write_text("\n".join(report))
        print("\n".join(report))


if __name__ == "__main__":
    main()
