"""``model="mesh"`` as a user sends it, against greedy, on task families nobody tuned it for.

The honest protocol (issue 43). Task *families* (not seeds) are split before anything is
measured: :data:`TUNING` – every family ``bench/moa.py`` and ``bench/moa_quality.py`` use, where
every rule and setting of ``mesh`` was and is chosen – and :data:`HELD_OUT` – reasoning-gym
families neither uses, chosen by greedy accuracy alone on a screening seed (phase ``screen``:
between 10 % and 50 %, so that there is room both ways) and never used for any choice.

Every item is asked, one request at a time on an idle in-process node (a real worker over HTTP
on loopback, the gateway's own ``MixtureOfAgents``), in each mode of :data:`MODES`:

- ``greedy``: the single model, ``temperature`` 0;
- ``mesh``: ``model="mesh"`` exactly as a user sends it – the body a chat-completions client
  posts (no metadata, temperature unset), parsed by the gateway's own parser – with the
  node's default configuration (``policy="auto"``);
- variants: ``mesh`` with a request or configuration change (each says which).

Graded with the project's own rule (``bench/moa_quality.py``'s ``is_correct``: the extracted
answer or the whole reply through reasoning-gym's scorer). Reported pooled and per family: each
mode against greedy, paired (wins / losses, sign test), and its time to the whole answer
(median and p90 against greedy's, and the median of the per-item ratios).

    python bench/moa_heldout.py screen --items 10
    python bench/moa_heldout.py run --families held-out --items 30 --modes greedy mesh
    python bench/moa_heldout.py repeat --items 2   # seeded vote requests, twice each
    python bench/moa_heldout.py report
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import statistics
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.moa import TASKS as POLICY_TASKS
from bench.moa_quality import (
    HELD_OUT_FAMILIES,
    SCREEN_FAMILIES,
    TUNING_FAMILIES,
    grade,
    sign_test_p,
    start_log,
)
from bench.moa_quality import TASKS as QUALITY_TASKS
from gateway.api.chat import parse
from gateway.events import Done, Error, Meta, TextDelta
from gateway.moa import MixtureOfAgents, MoaConfig
from gateway.upstream import ModelInfo, StaticDirectory, Upstream

RESULTS = Path(__file__).resolve().parent / "results"
LOG = RESULTS / "moa-heldout.jsonl"  # held-out families, cold prompts
TUNING_LOG = RESULTS / "moa-heldout-tuning.jsonl"  # tuning families (prompt cache on)
# Issue 43 item 3's sample styles, on tuning families first (cold prompts), then held out.
VARIANTS_TUNING_LOG = RESULTS / "moa-variants-tuning.jsonl"
VARIANTS_LOG = RESULTS / "moa-variants-heldout.jsonl"
OPEN_LOG = RESULTS / "moa-open-heldout.jsonl"  # item 5: open questions of held-out families
SCREEN_LOG = RESULTS / "moa-heldout-screen.jsonl"
# SmolLM2 + gemma3-270m in one mesh (``--models``): on main before the worker reported the
# converter's stand-in chat template as none, and after.
GEMMA_LOGS = {
    "on main (eca9cfb): gemma3-270m reported with a chat template": RESULTS
    / "moa-heldout-gemma-main.jsonl",
    "gemma3-270m reported without one (this branch)": RESULTS / "moa-heldout-gemma.jsonl",
}
REPORT = RESULTS / "moa-heldout.md"
SCREEN_SEED, RUN_SEED, REPEAT_SEED = 1001, 4343, 777
MAX_TOKENS = 40
OPEN_MAX_TOKENS = 160  # an open answer explains itself before its result
NUMBER_ONLY = "Answer with the number only."
FINAL_ONLY = "Answer with only the final answer."

Family = tuple[str, dict[str, Any], str]  # reasoning-gym name, its settings, the instruction


def _asked(families: dict[str, tuple[str, dict[str, Any]]]) -> dict[str, Family]:
    """Each family with the instruction its question ends with."""
    return {
        label: (name, cfg, NUMBER_ONLY if label in NUMBER_FAMILIES else FINAL_ONLY)
        for label, (name, cfg) in families.items()
    }


# Asked for "the number only" (the rest: "only the final answer").
NUMBER_FAMILIES = {
    *POLICY_TASKS,
    *("number_format", "number_sequence", "aiw", "simple_equations", "decimal_chain_sum"),
}
TUNING = _asked({**POLICY_TASKS, **QUALITY_TASKS})
SCREEN = _asked(SCREEN_FAMILIES)
HELD_OUT = _asked(HELD_OUT_FAMILIES)
assert not TUNING_FAMILIES & {name for name, _, _ in HELD_OUT.values()}, "a tuning family held out"


@dataclasses.dataclass(frozen=True)
class Mode:
    """One way of asking: the model named, body fields added, the node's MoA configuration."""

    model: str  # "single" (the one model) or "mesh"
    body: dict[str, Any] = dataclasses.field(default_factory=dict)
    config: MoaConfig = dataclasses.field(default_factory=lambda: MoaConfig(policy="auto"))
    note: str = ""
    open: bool = False  # the question alone, without "answer only": the model explains


MODES: dict[str, Mode] = {
    "greedy": Mode("single", {"temperature": 0}, note="the single model, temperature 0"),
    "mesh": Mode("mesh", note="as a user sends it: no metadata, temperature unset"),
    "vote": Mode(
        "mesh",
        {"metadata": {"moa_policy": "vote"}},
        note="the vote asked for (`metadata.moa_policy`), shipped settings",
    ),
    "vote, one batch": Mode(
        "mesh",
        {"metadata": {"moa_policy": "vote"}},
        MoaConfig(policy="auto", vote_wave=8),
        note="the vote asked for, its 8 samples started at once as one batch, stopped when decided",
    ),
    # Issue 43 item 3's variants, each one batch on the idle node (gateway/moa/sample_styles.py).
    "vote, framings": Mode(
        "mesh",
        {"metadata": {"moa_policy": "vote"}},
        MoaConfig(policy="auto", vote_wave=8, vote_style="framings"),
        note="the vote, one batch, its samples greedy under 7 framings of the task",
    ),
    "vote, reasoning": Mode(
        "mesh",
        {"metadata": {"moa_policy": "vote"}},
        MoaConfig(policy="auto", vote_wave=8, vote_style="reasoning"),
        note="the vote, one batch, each sample reasoning before an `Answer:` line (192 tokens)",
    ),
    "vote, CISC": Mode(
        "mesh",
        {"metadata": {"moa_policy": "vote"}},
        MoaConfig(policy="auto", vote_wave=8, vote_confidence_tau=0.2),
        note="the vote, one batch, every sample in, ballots weighted by confidence (CISC)",
    ),
    # Issue 43 item 5: open answers, the question without "answer only", 160 tokens.
    "open: greedy": Mode(
        "single",
        {"temperature": 0, "max_tokens": OPEN_MAX_TOKENS},
        note="open question, the single model, temperature 0",
        open=True,
    ),
    "open: mesh": Mode(
        "mesh",
        {"max_tokens": OPEN_MAX_TOKENS},
        note="open question, `mesh` as a user sends it",
        open=True,
    ),
    "open: consensus": Mode(
        "mesh",
        {"max_tokens": OPEN_MAX_TOKENS, "metadata": {"moa_policy": "judge", "moa_samples": "4"}},
        MoaConfig(policy="auto", judge_select="consensus"),
        note="open question, 4 complete samples, the one most like the others (confidence-weighted)",
        open=True,
    ),
    "vote, CISC, 4 samples": Mode(
        "mesh",
        {"metadata": {"moa_policy": "vote", "moa_samples": "4"}},
        MoaConfig(policy="auto", vote_wave=8, vote_confidence_tau=0.2),
        note="the same with 4 samples: half the batch, for the time",
    ),
    "race": Mode(
        "mesh",
        {"metadata": {"moa_policy": "race"}},
        note="the race asked for (`metadata.moa_policy`); `x-moa-winner` names whose text it is",
    ),
}


def families(which: str) -> dict[str, Family]:
    return {"tuning": TUNING, "held-out": HELD_OUT, "screen": SCREEN}[which]


def make_items(family: Family, count: int, seed: int) -> list[dict[str, Any]]:
    import reasoning_gym  # pip install -e '.[bench]'

    name, cfg, _ = family
    return list(reasoning_gym.create_dataset(name, size=count, seed=seed, **cfg))


def body_for(question: str, family: Family, mode: Mode, model: str) -> dict[str, Any]:
    """What a chat-completions client posts (the mode's fields added)."""
    content = question if mode.open else f"{question}\n{family[2]}"
    return {
        "model": model if mode.model == "single" else "mesh",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": MAX_TOKENS,
        **mode.body,
    }


async def ask(upstream: Upstream, body: dict[str, Any]) -> dict[str, Any]:
    """One answer through the gateway's parser: text, seconds to its end, the x-moa headers."""
    request, _ = parse(body)
    started = time.perf_counter()
    text, headers, finish = [], {}, "error"
    async for event in upstream.stream(request):
        if isinstance(event, TextDelta):
            text.append(event.text)
        elif isinstance(event, Meta):
            headers.update(event.headers)
        elif isinstance(event, Done):
            finish = event.finish_reason
        elif isinstance(event, Error):
            finish = f"error: {event.message}"
    seconds = time.perf_counter() - started
    return {"text": "".join(text), "s": seconds, "finish": finish, "headers": headers}


@contextlib.contextmanager
def node(model_dir: Path, prompt_cache: bool) -> Iterator[tuple[Upstream, StaticDirectory]]:
    """A real worker over HTTP on loopback, and the directory ``mesh`` sees (that one model).
    Without ``prompt_cache`` every request prefills its prompt, as a user's new question does:
    else the mode asked second would find the first one's prompt cached."""
    from gateway.worker_client import WorkerClient
    from worker.engine.types import EngineConfig
    from worker.testing import run_worker_in_thread

    config = EngineConfig() if prompt_cache else EngineConfig(prompt_cache_bytes=0)
    with run_worker_in_thread(model_dir, name=model_dir.name, config=config) as (url, _):
        worker = WorkerClient(url.removesuffix("/v1"), model_dir.name)
        directory = StaticDirectory()
        size = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
        directory.add(ModelInfo(model_dir.name, parameters=size), worker)
        yield worker, directory


@contextlib.asynccontextmanager
async def mesh_of(
    model_dir: Path, prompt_cache: bool, others: list[Path]
) -> AsyncIterator[tuple[Upstream, StaticDirectory]]:
    """:func:`node`, or with ``others`` several models in one mesh, a worker each (as ``mesh
    up`` serves them), each described as the worker reports it (``capabilities.chat_template``,
    parameters); the worker yielded is ``model_dir``'s, the one ``greedy`` asks."""
    if not others:
        with node(model_dir, prompt_cache) as pair:
            yield pair
        return
    from gateway.worker_client import WorkerClient
    from worker.engine.types import EngineConfig
    from worker.testing import run_worker_in_thread

    config = EngineConfig() if prompt_cache else EngineConfig(prompt_cache_bytes=0)
    directory = StaticDirectory()
    with contextlib.ExitStack() as stack:
        workers = []
        for path in (model_dir, *others):
            url, _ = stack.enter_context(run_worker_in_thread(path, name=path.name, config=config))
            worker = WorkerClient(url.removesuffix("/v1"), path.name)
            info = await worker.describe()
            print(f"{path.name}: parameters {info.parameters}, capabilities {info.capabilities}")
            directory.add(info, worker)
            workers.append(worker)
        yield workers[0], directory


async def run(args: argparse.Namespace) -> None:
    chosen = families(args.families)
    seed = SCREEN_SEED if args.phase == "screen" else args.seed
    log = SCREEN_LOG if args.phase == "screen" else args.log
    modes = ["greedy"] if args.phase == "screen" else args.modes
    header = {"model": args.model.name, "seed": seed, "max_tokens": MAX_TOKENS}
    if args.models:
        header["mesh"] = [args.model.name, *(m.name for m in args.models)]
    if args.prompt_cache:
        header["prompt_cache"] = "on"
    done = {(r["family"], r["index"], r["mode"]) for r in start_log(log, header)}
    async with mesh_of(args.model, args.prompt_cache, args.models) as (worker, directory):
        upstreams = {
            label: worker
            if MODES[label].model == "single"
            else MixtureOfAgents(directory, MODES[label].config)
            for label in modes
        }
        await ask(
            worker, {"model": args.model.name, "messages": [{"role": "user", "content": "Hi"}]}
        )
        pools = {label: make_items(f, args.items, seed) for label, f in chosen.items()}
        for index in range(args.items):  # round-robin, so a partial log covers every family
            for label, pool in pools.items():
                entry = pool[index]
                for mode in modes:  # one item's modes back to back: load drifts hit all alike
                    if (label, index, mode) in done:
                        continue
                    body = body_for(entry["question"], chosen[label], MODES[mode], args.model.name)
                    out = await ask(upstreams[mode], body)
                    ok = grade(chosen[label][:2], out["text"], entry)
                    row = {"family": label, "index": index, "mode": mode, "correct": ok, **out}
                    with log.open("ab") as fh:
                        fh.write(orjson.dumps(row) + b"\n")
                    print(f"{label} #{index} {mode}: {ok} {out['s']:.2f}s {out['text'][:60]!r}")


async def repeat(args: argparse.Namespace) -> None:
    """A seeded vote request sent twice through a real worker (waves, and one batch): are the
    two texts equal? ``--items`` questions per held-out family, from a seed of their own."""
    configs = {
        "waves": MoaConfig(policy="auto"),
        "one batch": MoaConfig(policy="auto", vote_wave=8),
    }
    with node(args.model, False) as (_, directory):
        for label, config in configs.items():
            moa, equal, total = MixtureOfAgents(directory, config), 0, 0
            for family in HELD_OUT.values():
                for entry in make_items(family, args.items, REPEAT_SEED):
                    body = body_for(entry["question"], family, MODES["vote"], args.model.name)
                    body["seed"] = 11
                    first, second = await ask(moa, body), await ask(moa, body)
                    total, equal = total + 1, equal + (first["text"] == second["text"])
            print(f"{label}: {equal} of {total} seeded requests gave the same text twice")


# -- report ------------------------------------------------------------------------------------


def _rows(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [r for r in map(orjson.loads, path.read_bytes().splitlines()) if "header" not in r]


def _by_item(rows: list[dict[str, Any]]) -> dict[tuple[str, int], dict[str, dict[str, Any]]]:
    items: dict[tuple[str, int], dict[str, dict[str, Any]]] = {}
    for r in rows:
        items.setdefault((r["family"], r["index"]), {})[r["mode"]] = r
    return items


def _p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10)[-1] if len(values) > 1 else values[0]


def compare(items: list[dict[str, dict[str, Any]]], mode: str) -> dict[str, Any]:
    """``mode`` against greedy on the items both answered."""
    pairs = [(i[mode], i["greedy"]) for i in items if mode in i and "greedy" in i]
    n = len(pairs)
    wins = sum(a["correct"] and not b["correct"] for a, b in pairs)
    losses = sum(b["correct"] and not a["correct"] for a, b in pairs)
    mine, base = [a["s"] for a, _ in pairs], [b["s"] for _, b in pairs]
    return {
        "n": n,
        "acc": sum(a["correct"] for a, _ in pairs) / n,
        "greedy": sum(b["correct"] for _, b in pairs) / n,
        "wins": wins,
        "losses": losses,
        "p": sign_test_p(wins, losses),
        "median_s": statistics.median(mine),
        "median_x": statistics.median(mine) / statistics.median(base),
        "p90_x": _p90(mine) / _p90(base),
        "ratio_x": statistics.median(a / b for a, b in zip(mine, base, strict=True)),
        "started": statistics.mean(int(a["headers"].get("x-moa-workers", 1)) for a, _ in pairs),
    }


def verdict(c: dict[str, Any]) -> str:
    """Issue 43's bars: the vote's (≥ +3 points, p < 0.05, median ≤ 2×, p90 ≤ 3× greedy's) and
    the fallback's (within one point of greedy at ≤ 1.25× its median time)."""
    delta = 100 * (c["acc"] - c["greedy"])
    if delta >= 3 and c["p"] < 0.05 and c["median_x"] <= 2 and c["p90_x"] <= 3:
        return "beats greedy (the bar)"
    if abs(delta) <= 1 and c["median_x"] <= 1.25:
        return "greedy's equal at ≤ 1.25× (the fallback bar)"
    return "neither bar"


def table(rows: list[dict[str, Any]], title: str) -> list[str]:
    items = _by_item(rows)
    fams = sorted({f for f, _ in items})
    seen = list(dict.fromkeys(m for i in items.values() for m in i))
    modes = [m for m in MODES if m in seen] + [m for m in seen if m not in MODES]
    lines = [
        f"### {title}: {len(items)} items, {len(fams)} families",
        "",
        "| mode | accuracy | greedy on the same items | vs greedy (wins / losses) | sign test p "
        "| median time | median × greedy | p90 × greedy | median of per-item × | calls started "
        "| issue 43's bars |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for mode in modes:
        c = compare(list(items.values()), mode)
        if not c["n"]:
            continue
        lines.append(
            f"| {mode} | {100 * c['acc']:.1f} % (n = {c['n']}) | {100 * c['greedy']:.1f} % | "
            f"{c['wins']} / {c['losses']} | {c['p']:.3g} | {c['median_s']:.2f} s | "
            f"{c['median_x']:.2f}× | {c['p90_x']:.2f}× | {c['ratio_x']:.2f}× | "
            f"{c['started']:.2f} | {verdict(c) if mode != 'greedy' else ''} |"
        )
    lines += ["", "Per family (accuracy; time: median × greedy):", ""]
    lines += ["| family | n | " + " | ".join(modes) + " |", "|---|---:|" + "---:|" * len(modes)]
    for fam in fams:
        mine = [i for (f, _), i in items.items() if f == fam]
        cells = []
        for mode in modes:
            c = compare(mine, mode) if any(mode in i for i in mine) else None
            cells.append(f"{100 * c['acc']:.0f} % ({c['median_x']:.1f}×)" if c else "–")
        lines.append(f"| {fam} | {len(mine)} | {' | '.join(cells)} |")
    return lines


def degeneration(rows: list[dict[str, Any]]) -> list[str]:
    """Per mode: answers cut off by ``max_tokens``, and answers the gates call a loop."""
    from gateway.moa import gates

    lines = ["| mode | answers | cut off (max_tokens) | loops (repetition gate) |", "|---|---:|---:|---:|"]  # fmt: skip
    for mode in dict.fromkeys(r["mode"] for r in rows):
        mine = [r for r in rows if r["mode"] == mode]
        cut = sum(r["finish"] == "length" for r in mine)
        loops = sum(gates.judge(r["text"]) is gates.Verdict.REPETITION for r in mine)
        n = len(mine)
        lines.append(f"| {mode} | {n} | {cut} ({100 * cut / n:.0f} %) | {loops} ({100 * loops / n:.0f} %) |")  # fmt: skip
    return lines


def winners(rows: list[dict[str, Any]], mode: str) -> str:
    """Whose text ``mode`` answered with (``x-moa-winner``, the sample number dropped)."""
    counts: dict[str, int] = {}
    for r in rows:
        if r["mode"] == mode:
            model = str(r["headers"].get("x-moa-winner", "?")).split("#")[0]
            counts[model] = counts.get(model, 0) + 1
    return ", ".join(f"{model} {n}" for model, n in sorted(counts.items(), key=lambda kv: -kv[1]))


def screen_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| family | items | greedy | kept |", "|---|---:|---:|:---:|"]
    for fam in SCREEN:
        mine = [r for r in rows if r["family"] == fam]
        if mine:
            acc = 100 * sum(r["correct"] for r in mine) / len(mine)
            kept = "yes" if fam in HELD_OUT else ""
            lines.append(f"| {fam} | {len(mine)} | {acc:.0f} % | {kept} |")
    return lines


NOTES = """## What was tried, and what it shows

Every variant was chosen on tuning families and only then run on the held-out ones:

- `vote` with the greedy anchor (the caller's own sample greedy when temperature is unset),
  ballots in lockstep order and echoes of the question not voting (commit 6c3cba2): on tuning
  families +5 points (2 wins / 0 losses, p = 0.5) at 4.1x greedy's median time – already past
  the 2x the bar allows.
- `vote, one batch` (the same, its 8 samples started at once and stopped when decided, as the
  issue proposes for an idle node): on tuning families +0 points (2 / 2) at 2.0x, the nearer to
  the bar, so it was the variant taken to the held-out families: +0.8 points (3 / 2, p = 1) at
  3.1x greedy's median (p90 2.8x). An 8-row batch on this 2-core CPU costs more per step than
  the one row greedy decodes.
- `vote` (waves of 2, the shipped setting) on the held-out families too, for the record: 13.3 %
  against greedy's 17.5 % (1 / 6, p = 0.125) at 4.2x greedy's median. It ran after the others,
  so its times are paired with greedy's from the earlier pass and carry the load drift.
- Before these changes (issue 43's run on main, 204 items of six other families): `mesh` as a
  user sent it 23.0 % vs greedy's 22.5 % (17 / 16, p = 1.0) at 4.5x the mean time; the vote
  asked for 26.5 % (25 / 17, p = 0.28) at 4.5x.

No variant meets the bar (>= greedy + 3 points, p < 0.05, median <= 2x, p90 <= 3x). So `auto`
no longer votes: a short-answer question gets the best model's one greedy answer (`single`),
and `mesh` as a user sends it gives the very text greedy gives (120 of 120; 0 wins / 0 losses)
at 0.90x its median time and 1.04x its p90 – within one point at <= 1.25x, the fallback
bar. The vote stays one metadata field away (`"moa_policy": "vote"`).

A seeded request is repeatable through a real worker too (`repeat --items 2`: the vote asked
for, seed 11, two runs of each of 12 held-out questions): 12 of 12 texts equal in waves and 12
of 12 as one batch. (Issue 43 found 113 of 204 equal before these changes, unseeded requests
whose own sample ran at T = 0.2; the old code was not rerun here, so how much of that the
lockstep ballot order fixes, and how much the greedy anchor, is not measured.)

By hand, as a new user would (`mesh up` with SmolLM2, then `mesh chat --model mesh "What is
7 + 8? Answer with the number only."`, twice, beside `--model smollm2-135m`): "7 + 8 = 15" in
2.05 s and 1.64 s against 1.92 s and 1.79 s (issue 43: 23.5 s against 1.6 s); headers
`x-moa-policy: single`, `x-moa-auto: short-answer`, `x-moa-workers: 1`.

Setup: SmolLM2-135M, one in-process node (a real worker over HTTP on loopback, the gateway's
`MixtureOfAgents`) on a shared 2-core CPU (another benchmark ran beside it: times are paired
per item, modes back to back), `max_tokens` 40, one request at a time. Held-out prompts are
cold (the worker's prompt cache off: else the mode asked second finds the first one's prompt
cached); the tuning pass kept the cache on, which flatters the modes asked after greedy.
"""


VARIANT_NOTES = """## Sample styles (issue 43, item 3)

The vote's samples made to differ in other ways than temperature (gateway/moa/sample_styles.py,
``MoaConfig.vote_style`` and ``vote_confidence_tau``), each one batch on the idle node: greedy
samples under seven framings of the task; samples that reason before an `Answer:` line (192
tokens); confidence-weighted ballots (CISC, every sample in). Measured first on the tuning
families, cold prompts, beside greedy in the same pass:

    python bench/moa_heldout.py run --families tuning --items 4 \\
        --modes greedy "vote, framings" "vote, CISC" "vote, reasoning" \\
        --log bench/results/moa-variants-tuning.jsonl   # then "vote, CISC, 4 samples"

On the tuning families framings gave +2.5 points (3 / 2) at 2.3x greedy's median time,
reasoning -2.5 (3 / 4) at 2.7x (SmolLM2-135M's reasoning states false steps: many samples
abstain, refuted by their own false equations), CISC +10 (4 / 0, p = 0.125) at 3.6x, and CISC
with 4 samples +2.5 (2 / 1) at 1.9x. Only CISC moved the tuning families, so only CISC (and its
4-sample form, the one inside the time bar) went to the held-out families: **15.0 % against
greedy's 16.7 % (8 / 10, p = 0.82) at 4.5x, and 15.0 % (6 / 8, p = 0.79) at 3.0x** – the
tuning gain did not travel. No sample style beats greedy on held-out families; `auto` keeps
answering short questions with one greedy answer.
"""

OPEN_NOTES = """## Open answers (issue 43, item 5)

The question alone, without "answer only" (the model explains in its own words, 160 tokens),
graded on its final answer as above: greedy; `mesh` as a user sends it; and four complete
samples of which the one most like the others stands (`judge` with
``judge_select="consensus"``, gateway/moa/central.py). Degeneration below: answers cut off by
`max_tokens`, and answers the repetition gate calls a loop.

    python bench/moa_heldout.py run --families held-out --items 12 \\
        --modes "open: greedy" "open: mesh" "open: consensus" --log bench/results/moa-open-heldout.jsonl

On 72 items consensus among four complete samples answered right less often than greedy
(5.6 % against 12.5 %, 0 / 5, p = 0.06) at 3.1x its median time, though it was cut off by
`max_tokens` half as often (17 % against 36 %) and never looped (greedy 4 %): the sample most
like the others is the plainest and shortest, which often stops before its result. `mesh` as a
user sends it (`auto` takes `race` for open questions: three samples, the caller's first) got
9.7 % (3 / 5, p = 0.73) at 1.23x. So `race` stays the default for open answers, where the live
stream matters; consensus is an opt-in (`metadata.moa_policy = "judge"`, `moa_select =
"consensus"`) for fewer cut-off and looping answers, not for more right ones.
"""


GEMMA_NOTES = """## SmolLM2 + gemma3-270m in one mesh

Issue 43's second bar: with the base gemma3-270m beside SmolLM2, `mesh` as a user sends it
must do no worse than SmolLM2 alone, and `race` must answer with SmolLM2. Same held-out items
(seed 4343, 20 per family), two workers in one directory as `mesh up` serves two models, each
described as its worker reports it (`--models`), one request at a time, greedy = SmolLM2 at
temperature 0:

    python bench/moa_heldout.py run --model ~/.mlx-mesh/models/smollm2-135m \\
        --models ~/.mlx-mesh/models/gemma3-270m --items 20 --modes greedy mesh \\
        --log bench/results/moa-heldout-gemma.jsonl   # then --items 2 --modes greedy mesh race

On main (eca9cfb) `mesh` left gemma3-270m in: its GGUF (`mesh models pull gemma3-270m`) has
no chat template, so the converter writes a plain role-prefixed stand-in
(`{{ bos_token }}User: …\\n\\nAssistant:`) into `tokenizer_config.json`, and the worker reported
`capabilities.chat_template: true` for it – the filter that leaves base models out never
fired. `mixable_models` orders candidates by parameters, largest first (268,098,176 against
SmolLM2's 134,515,008), so `single` – what `auto` picks for these short-answer questions –
asked gemma3 on 120 of 120 items: it continues the prompt (echoes the question, writes the
next `User:` turn) and `mesh` fell to 2.5 % against SmolLM2's 18.3 % (1 win / 20 losses,
p = 2e-05) at 1.83x greedy's median time; `race` (both models started) answered with gemma3's
text on 7 of 12 items (those 12 ran first, on a busier CPU: mind their times). Now the worker reports the converter's stand-in as no chat template
(`is_fallback_template`), so gemma3-270m is no candidate while SmolLM2 is there: `mesh` gives
SmolLM2's greedy text on 120 of 120 items (16.7 % = 16.7 %, 0 / 0, p = 1) at 0.96x greedy's
median time (p90 0.89x), and `race` answers with SmolLM2 (its three samples) on 12 of 12.

Greedy itself is not bit-for-bit repeatable on this shared CPU: SmolLM2's greedy text differs
on 4 of 120 items (ransom_note True/False) between the two runs below, hence 18.3 % against
16.7 %; within each run every mode is paired with that run's greedy.
"""


def report(args: argparse.Namespace) -> str:
    # The logs that have sections of their own below are not the held-out table's source.
    own = {*GEMMA_LOGS.values(), VARIANTS_TUNING_LOG, VARIANTS_LOG, OPEN_LOG}
    source = LOG if args.log.resolve() in {p.resolve() for p in own} else args.log
    held = [r for r in _rows(source) if r["family"] in HELD_OUT]
    tuning = [r for r in _rows(TUNING_LOG) if r["family"] in TUNING]
    lines = [
        "# `mesh` on held-out task families (issue 43)",
        "",
        f"Written by `python bench/moa_heldout.py report` from `{source.name}`.",
        "",
        f"Tuning families (every rule and setting chosen here): {', '.join(sorted(TUNING))}.",
        f"Held-out families (never used for any choice): {', '.join(HELD_OUT) or 'none yet'}.",
        "",
        "Modes:",
        "",
        *(f"- `{label}`: {mode.note}" for label, mode in MODES.items()),
        "",
    ]
    lines += [NOTES, ""]
    if held:
        lines += [*table(held, "Held-out families (cold prompts)"), ""]
    if tuning:
        title = "Tuning families (prompt cache on: modes after greedy found its prompt cached)"
        lines += [*table(tuning, title), ""]
    variants = [r for r in _rows(VARIANTS_TUNING_LOG) if r["family"] in TUNING]
    if variants:
        lines += [VARIANT_NOTES, "", *table(variants, "Sample styles, tuning families (cold prompts)"), ""]  # fmt: skip
    variants = [r for r in _rows(VARIANTS_LOG) if r["family"] in HELD_OUT]
    if variants:
        lines += [*table(variants, "Sample styles, held-out families (cold prompts)"), ""]
    opened = [r | {"mode": r["mode"].removeprefix("open: ")} for r in _rows(OPEN_LOG) if r["family"] in HELD_OUT]  # fmt: skip
    if opened:
        lines += [OPEN_NOTES, "", *table(opened, "Open questions, held-out families"), ""]
        lines += ["Degeneration over the same open answers:", "", *degeneration(opened), ""]
    for title, path in GEMMA_LOGS.items():
        rows = [r for r in _rows(path) if r["family"] in HELD_OUT]
        if not rows:
            continue
        if title == next(iter(GEMMA_LOGS)):
            lines += [GEMMA_NOTES, ""]
        lines += [*table(rows, f"SmolLM2 + gemma3-270m, {title}"), ""]
        for mode in ("mesh", "race"):
            if any(r["mode"] == mode for r in rows):
                lines += [f"`{mode}` answered with: {winners(rows, mode)}.", ""]
    screen = _rows(SCREEN_LOG)
    if screen:
        lines += ["## Screening (greedy only, seed 1001)", "", *screen_table(screen), ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("phase", choices=("screen", "run", "repeat", "report"))
    parser.add_argument("--model", type=Path, default=Path.home() / ".mlx-mesh/models/smollm2-135m")
    parser.add_argument(
        "--models", type=Path, nargs="*", default=[], help="more models in the mesh, a worker each"
    )
    parser.add_argument("--families", choices=("tuning", "held-out", "screen"), default="held-out")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=["greedy", "mesh"])
    parser.add_argument("--items", type=int, default=30, help="per family")
    parser.add_argument("--seed", type=int, default=RUN_SEED)
    parser.add_argument("--log", type=Path, default=None, help="default: by --families")
    parser.add_argument(
        "--prompt-cache", action="store_true", help="keep the worker's prompt cache (default off)"
    )
    args = parser.parse_args()
    if args.log is None:
        args.log = TUNING_LOG if args.families == "tuning" else LOG
    if args.phase == "screen":
        args.families = "screen"
    if args.phase == "repeat":
        asyncio.run(repeat(args))
        return
    if args.phase != "report":
        asyncio.run(run(args))
    text = report(args)
    REPORT.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
