"""Does ``model="mesh"`` answer better than one model? Self-mixture policies on reasoning-gym.

Recording (the expensive part, resumable): for each item, one greedy answer (temperature 0,
the baseline) and ``--samples`` answers at the model's own default sampling
(``generation_config``; each with its own seed), all sent at once to one real worker, so they
share one prefill and decode as one batch – exactly the calls ``vote`` makes. Each answer is
kept with its per-token log-probabilities, finish reason and token count in an item log (one
JSON line per item); rerunning the same command resumes after the last logged item.

Deciding (cheap, offline, exact): every policy runs its *real* pure core
(:class:`gateway.moa.arbiter.Arbiter`) over the recorded streams replayed in decode order
(samples of one batch decode in lockstep, one token per step), so the samples it stops and the
tokens they would have decoded are what the live gateway would save.

Phases:
- ``screen``: pass@1 (mean over samples) and pass@8 per candidate task on a few items of a
  screening seed; tasks with pass@8 − pass@1 ≥ 10 points are kept (``--tasks`` can name them).
- ``eval``: the kept tasks on another seed, ``--items`` per task; the report
  (``bench/results/moa-quality.md`` + ``moa-quality-n.png``): greedy single, one sample at the
  default temperature, race, vote (N = 8 and the N sweep 1, 2, 4, 8, 16), auto; paired sign
  tests; samples used; tokens decoded per answer and wall time per item.

    python bench/moa_quality.py screen --model ~/.mlx-mesh/models/smollm2-135m --items 12
    python bench/moa_quality.py eval --model ~/.mlx-mesh/models/smollm2-135m --items 50
    python bench/moa_quality.py report   # from the logs only
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import math
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gateway.events import Done, Error, TextDelta, Usage
from gateway.moa.answers import extract_answer
from gateway.moa.arbiter import Arbiter
from gateway.moa.auto import choose_policy
from gateway.moa.config import MoaConfig
from gateway.moa.events import TokenArrived, WorkerFinished, WorkerStarted
from gateway.request import ChatRequest, Message

RESULTS = Path(__file__).resolve().parent / "results"
SCREEN_SEED, EVAL_SEED = 1001, 2002
INSTRUCTION = "Reply with only the final answer."
# Candidate tasks, easy settings (a 135M model must get some right), chosen before measuring:
# arithmetic, counting, string manipulation and number theory, so the selection stays general.
TASKS: dict[str, tuple[str, dict[str, Any]]] = {
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
    "chain_sum_3": (
        "chain_sum",
        {"min_terms": 3, "max_terms": 3, "min_digits": 1, "max_digits": 1},
    ),
    "products_1digit": (
        "products",
        {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
    ),
    "leg_counting": ("leg_counting", {"min_animals": 1, "max_animals": 1, "max_instances": 3}),
    "letter_counting": ("letter_counting", {"min_words": 3, "max_words": 5}),
    "spell_backward": ("spell_backward", {"min_word_len": 3, "max_word_len": 4}),
    "gcd_small": ("gcd", {"min_numbers": 2, "max_numbers": 2, "min_value": 2, "max_value": 30}),
    "lcm_small": ("lcm", {"min_numbers": 2, "max_numbers": 2, "min_value": 2, "max_value": 12}),
    "count_bits_small": ("count_bits", {"min_n": 1, "max_n": 64}),
}
N_SWEEP = (1, 2, 4, 8, 16)


# -- recording ---------------------------------------------------------------------------------


def make_items(task: str, count: int, seed: int) -> list[dict[str, Any]]:
    import reasoning_gym  # pip install -e '.[bench]'

    name, cfg = TASKS[task]
    return list(reasoning_gym.create_dataset(name, size=count, seed=seed, **cfg))


def is_correct(task: str, text: str, entry: dict[str, Any]) -> bool:
    """reasoning-gym's own scorer on the extracted answer (or the whole reply), or equal
    extracted answers."""
    import reasoning_gym

    dataset = reasoning_gym.create_dataset(TASKS[task][0], size=1, seed=0, **TASKS[task][1])
    extracted = extract_answer(text)
    for guess in filter(None, (extracted, text.strip())):
        with contextlib.suppress(Exception):  # some scorers raise on malformed answers
            if dataset.score_answer(guess, entry) >= 1.0:
                return True
    return extracted is not None and extracted == extract_answer(str(entry["answer"]))


async def sample(client: Any, request: ChatRequest) -> dict[str, Any]:
    """One answer: text, per-delta log-probabilities, finish reason, completion tokens."""
    text, logprobs, finish, tokens = [], [], "error", 0
    async for event in client.stream(request):
        if isinstance(event, TextDelta):
            text.append(event.text)
            logprobs.append(event.logprob)
        elif isinstance(event, Usage):
            tokens = event.completion_tokens
        elif isinstance(event, Done):
            finish = event.finish_reason
        elif isinstance(event, Error):
            finish = f"error: {event.message}"
    return {"text": "".join(text), "logprobs": logprobs, "finish": finish, "tokens": tokens}


def request_for(question: str, max_tokens: int, **fields: Any) -> ChatRequest:
    content = f"{question}\n{INSTRUCTION}"
    return ChatRequest(
        model="m",
        messages=[Message(role="user", content=content)],
        max_tokens=max_tokens,
        metadata={"logprobs": True},
        **fields,
    )


@contextlib.contextmanager
def worker(model_dir: Path) -> Iterator[Any]:
    from gateway.worker_client import WorkerClient
    from worker.testing import run_worker_in_thread

    with run_worker_in_thread(model_dir, name=model_dir.name) as (url, _):
        yield WorkerClient(url.removesuffix("/v1"), model_dir.name)


def read_log(path: Path, header: dict[str, Any]) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    lines = [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]
    if lines and lines[0] != {"header": orjson.loads(orjson.dumps(header))}:
        raise SystemExit(f"{path} was written with other settings; use another --log")
    return lines[1:]


def start_log(path: Path, header: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows logged so far with these settings; a new log starts with its header."""
    rows = read_log(path, header)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(orjson.dumps({"header": header}) + b"\n")
    return rows


async def record(args: argparse.Namespace, seed: int, log: Path) -> None:
    header = {
        "model": args.model.name,
        "tasks": {t: TASKS[t] for t in args.tasks},
        "seed": seed,
        "samples": args.samples,
        "max_tokens": args.max_tokens,
        "instruction": INSTRUCTION,
    }
    done = {(r["task"], r["index"]) for r in start_log(log, header)}
    deadline = time.monotonic() + args.time_budget_s
    with worker(args.model) as client:
        # Round-robin over tasks, so a partial log still covers every task evenly.
        pools = {t: make_items(t, args.items, seed) for t in args.tasks}
        for index in range(args.items):
            for task, pool in pools.items():
                if (task, index) in done:
                    continue
                if time.monotonic() > deadline:
                    print("time budget spent; rerun the same command to resume", flush=True)
                    return
                entry = pool[index]
                greedy = request_for(entry["question"], args.max_tokens, temperature=0.0)
                samples = [
                    request_for(entry["question"], args.max_tokens, seed=seed * 100 + i)
                    for i in range(args.samples)
                ]
                started = time.monotonic()
                answers = await asyncio.gather(*(sample(client, r) for r in [greedy, *samples]))
                row = {
                    "task": task,
                    "index": index,
                    "question": entry["question"],
                    "answer": str(entry["answer"]),
                    "greedy": answers[0],
                    "samples": answers[1:],
                    "correct": [is_correct(task, a["text"], entry) for a in answers],
                    "wall_s": time.monotonic() - started,
                }
                with log.open("ab") as fh:
                    fh.write(orjson.dumps(row) + b"\n")
                hits = sum(row["correct"][1:])
                print(
                    f"{task} #{index}: greedy {row['correct'][0]}, samples {hits}/"
                    f"{args.samples}, {row['wall_s']:.1f}s",
                    flush=True,
                )


# -- deciding, offline -------------------------------------------------------------------------


@dataclasses.dataclass
class Outcome:
    winner: int | None  # index into the candidates
    used: int  # samples that finished (voted or abstained) before the decision
    tokens: int  # tokens decoded in all, the stopped samples' included
    decided_step: int


def replay(policy: str, answers: list[dict[str, Any]], config: MoaConfig) -> Outcome:
    """Run the arbiter over recorded answers decoding in lockstep: step k delivers every live
    answer's k-th delta; an answer ends one step after its last delta."""
    names = [f"s{i}" for i in range(len(answers))]
    arbiter = Arbiter(names, config, now=0.0, policy=policy, preferred=names[0])  # type: ignore[arg-type]
    for name in names:
        arbiter.handle(WorkerStarted(name), 0.0)
    longest = max((len(a["logprobs"]) for a in answers), default=0)
    finished = 0
    for step in range(longest + 1):
        for i, a in enumerate(answers):
            deltas = a["logprobs"]
            if step < len(deltas):
                piece = _pieces(a)[step]
                arbiter.handle(TokenArrived(names[i], piece, logprob=deltas[step]), float(step))
            elif step == len(deltas):
                finished += 1
                finish = a["finish"] if a["finish"] in ("stop", "length") else "stop"
                arbiter.handle(WorkerFinished(names[i], finish), float(step))
            if arbiter.winner is not None:
                tokens = sum(min(len(x["logprobs"]), step + 1) for x in answers)
                # The winner decodes on to its end (race commits to a stream still running).
                won = answers[names.index(arbiter.winner)]
                tokens += max(0, len(won["logprobs"]) - (step + 1))
                used = sum(1 for x in answers if len(x["logprobs"]) <= step)
                return Outcome(names.index(arbiter.winner), used, tokens, step)
    return Outcome(None, len(answers), sum(len(a["logprobs"]) for a in answers), longest)


def _pieces(answer: dict[str, Any]) -> list[str]:
    """The recorded text cut into as many pieces as it had deltas (their texts are not kept
    apart; only the whole text and the per-delta log-probabilities matter to the arbiter)."""
    cache = answer.get("_pieces")
    if cache is None:
        text, n = answer["text"], max(1, len(answer["logprobs"]))
        size = math.ceil(len(text) / n) if text else 0
        cache = [text[i * size : (i + 1) * size] for i in range(n)]
        answer["_pieces"] = cache
    return cache


def sign_test_p(wins: int, losses: int) -> float:
    n = wins + losses
    if n == 0:
        return 1.0
    return min(1.0, 2 * sum(math.comb(n, k) for k in range(min(wins, losses) + 1)) / 2**n)


def evaluate(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per policy: correct per item, samples used, tokens decoded."""
    config = MoaConfig()
    out: dict[str, dict[str, list[Any]]] = {}

    def note(label: str, hit: bool, used: int, tokens: int) -> None:
        slot = out.setdefault(label, {"hit": [], "used": [], "tokens": []})
        slot["hit"].append(hit)
        slot["used"].append(used)
        slot["tokens"].append(tokens)

    for row in rows:
        greedy, samples, correct = row["greedy"], row["samples"], row["correct"]
        note("single greedy", correct[0], 1, len(greedy["logprobs"]))
        note("single sample (default T)", correct[1], 1, len(samples[0]["logprobs"]))
        # race: the caller's own (greedy) request plus two samples, as plan_candidates makes.
        race = replay("race", [greedy, *samples[:2]], config)
        note(
            "mesh race (3)", bool(race.winner is not None and correct[race.winner]), 3, race.tokens
        )
        # vote: the caller's request (greedy) is sample 0, the others at the default T.
        for n in N_SWEEP:
            if n > len(samples) + 1:
                continue
            pool = [greedy, *samples[: n - 1]]
            vote = replay("vote", pool, config)
            hit = bool(vote.winner is not None and correct[vote.winner])
            note(f"mesh vote (N={n})", hit, vote.used, vote.tokens)
        question = row.get("question", "")
        policy, _ = choose_policy(request_for(question, 64)) if question else ("vote", "")
        label = "mesh vote (N=8)" if policy == "vote" else "mesh race (3)"
        note("mesh auto", out[label]["hit"][-1], out[label]["used"][-1], out[label]["tokens"][-1])
        note("oracle (any of the N=8 pool)", any(correct[:8]), 8, 0)
    return out


def report(
    screen_rows: list[dict[str, Any]],
    eval_rows: list[dict[str, Any]],
    args: argparse.Namespace,
    partial: bool,
) -> str:
    lines = ['# `model="mesh"` answer quality: self-mixture on SmolLM2-135M', ""]
    if partial:
        lines += [
            "**PARTIAL RESULTS** – the recording did not finish on the shared 2-core box (about "
            "20–50 s per item for greedy + 8 samples). Resume, then run the kept tasks (each "
            "command continues its item log where it stopped):",
            "",
            "    export LD_PRELOAD=\"$(.venv/bin/python -c 'from worker.cpu import preload_env; "
            'print(preload_env().get("LD_PRELOAD", ""))\')"',
            "    .venv/bin/python bench/moa_quality.py screen --items 8 --samples 8",
            "    .venv/bin/python bench/moa_quality.py eval --items 50 --samples 16 --tasks <kept>",
            "",
        ]
    lines += [
        "## Screening: pass@1 vs pass@8 per task",
        "",
        f"Seed {SCREEN_SEED}; pass@1 = mean correctness of the default-temperature samples, "
        "pass@8 = any of 8 correct.",
        "",
        "| task | items | greedy | pass@1 | pass@8 | gap (points) | kept |",
        "|---|---:|---:|---:|---:|---:|:---:|",
    ]
    for task in TASKS:
        rows = [r for r in screen_rows if r["task"] == task]
        if not rows:
            continue
        greedy = sum(r["correct"][0] for r in rows) / len(rows)
        p1 = sum(sum(r["correct"][1:9]) / 8 for r in rows) / len(rows)
        p8 = sum(any(r["correct"][1:9]) for r in rows) / len(rows)
        kept = "yes" if 100 * (p8 - p1) >= 10 else ""
        lines.append(
            f"| {task} | {len(rows)} | {100 * greedy:.0f} % | {100 * p1:.0f} % | "
            f"{100 * p8:.0f} % | {100 * (p8 - p1):.0f} | {kept} |"
        )
    if eval_rows:
        lines += ["", *policy_section(eval_rows, args)]
    elif screen_rows:
        lines += [
            "",
            "The evaluation phase has not run: the policies below are replayed over the",
            "*screening* items (all candidate tasks, few items) – an early look, not the "
            "done-when.",
            "",
            *policy_section(screen_rows, args, seed=SCREEN_SEED),
        ]
    return "\n".join(lines) + "\n"


def policy_section(
    rows: list[dict[str, Any]], args: argparse.Namespace, seed: int = EVAL_SEED
) -> list[str]:
    results = evaluate(rows)
    n = len(rows)
    tasks = sorted({r["task"] for r in rows})
    wall = sum(r["wall_s"] for r in rows) / n
    lines = [
        f"## Policies on {n} items ({', '.join(tasks)}; seed {seed})",
        "",
        "| mode | correct | samples used (of N) | tokens decoded / answer |",
        "|---|---:|---:|---:|",
    ]
    for label, r in results.items():
        hits = sum(r["hit"])
        used = sum(r["used"]) / n
        tokens = sum(r["tokens"]) / n
        lines.append(
            f"| {label} | {hits}/{n} ({100 * hits / n:.1f} %) | {used:.2f} | {tokens:.0f} |"
        )
    lines += [
        "",
        f"Recording wall time per item (greedy + {len(rows[0]['samples'])} samples, "
        f"one batch): {wall:.1f} s.",
        "",
        "Paired sign tests against the best single mode:",
        "",
    ]
    singles = ["single greedy", "single sample (default T)"]
    best = max(singles, key=lambda s: sum(results[s]["hit"]))
    for label in results:
        if not label.startswith("mesh"):
            continue
        wins = sum(
            a and not b for a, b in zip(results[label]["hit"], results[best]["hit"], strict=True)
        )
        losses = sum(
            b and not a for a, b in zip(results[label]["hit"], results[best]["hit"], strict=True)
        )
        delta = 100 * (sum(results[label]["hit"]) - sum(results[best]["hit"])) / n
        lines.append(
            f"- {label} vs {best}: {delta:+.1f} points, {wins} wins / {losses} losses, "
            f"p = {sign_test_p(wins, losses):.3g}"
        )
    plot(results, n)
    lines += ["", "![accuracy against N](moa-quality-n.png)"]
    return lines


def plot(results: dict[str, Any], n: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [k for k in N_SWEEP if f"mesh vote (N={k})" in results]
    ys = [100 * sum(results[f"mesh vote (N={k})"]["hit"]) / n for k in xs]
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot(xs, ys, marker="o", label="vote")
    for label, style in (("single greedy", "--"), ("single sample (default T)", ":")):
        ax.axhline(100 * sum(results[label]["hit"]) / n, linestyle=style, color="grey", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("samples N")
    ax.set_ylabel("exact match (%)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(RESULTS / "moa-quality-n.png", dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("phase", choices=("screen", "eval", "report"))
    parser.add_argument("--model", type=Path, default=Path.home() / ".mlx-mesh/models/smollm2-135m")
    parser.add_argument("--tasks", nargs="*", default=list(TASKS))
    parser.add_argument("--items", type=int, default=50, help="per task")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--time-budget-s", type=float, default=math.inf)
    parser.add_argument("--screen-log", type=Path, default=RESULTS / "moa-quality-screen.jsonl")
    parser.add_argument("--eval-log", type=Path, default=RESULTS / "moa-quality-items.jsonl")
    args = parser.parse_args()
    if args.phase == "screen":
        args.samples = max(args.samples, 8)
        asyncio.run(record(args, SCREEN_SEED, args.screen_log))
    elif args.phase == "eval":
        asyncio.run(record(args, EVAL_SEED, args.eval_log))
    screen = _rows(args.screen_log)
    evals = _rows(args.eval_log)
    partial = len({r["task"] for r in evals}) < 6 or len(evals) < 300
    (RESULTS / "moa-quality.md").write_text(report(screen, evals, args, partial))
    print((RESULTS / "moa-quality.md").read_text())


def _rows(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    lines = [orjson.loads(x) for x in path.read_bytes().splitlines() if x.strip()]
    return [r for r in lines if "header" not in r]


if __name__ == "__main__":
    main()
