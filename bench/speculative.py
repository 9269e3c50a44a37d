"""Benchmark: speculative decoding (prompt lookup) against the same engine with it off.

One process, two engines on the same model (``EngineConfig.speculation`` "off" = baseline,
"auto"), each workload run on both in turn, in the same run. Workloads (issue 24):

- agent edit: a 60-120-line file of this repository, returned with one change;
- Claude Code turn: the captured request that hands a Bash result back
  (tests/fixtures/claude_code_requests.json) as the worker renders it behind a node;
- open chat: a question whose answer shares nothing with the prompt.

Temperature 0 and 0.7 (seeded), 1 and 4 concurrent streams (every item of a workload runs:
with fewer streams than items, in rounds one after another), ``--trials`` runs of each with
off and on alternating first (medians; the ratio is the median of the paired ones). Decode
tok/s = completion tokens after each stream's first token / the time from the first stream's
first token to the last stream's end. Also: acceptance and tokens per verify step (the
engine's counters), and the cost of a verify pass by batch rows and width (what the
``Speculation.max_rows`` default rests on), the lookup ceiling (the tokens a pass the
baseline's own answer allows prompt lookup: ``worker.speculative.policy.lookup_ceiling``) and the
start of each answer. The box is shared: only
same-run ratios mean anything.

    nice -n 5 python bench/speculative.py [--model DIR] [--max-tokens 96] [--draft-model DIR]
        [--workloads "agent edit,open chat"] [--streams 1,4] [--trials 3] [--no-costs] [--out FILE]
        [--without-guesses]

``--draft-model`` adds a third engine that drafts with that model (same tokenizer) and a
table of its own; ``--without-guesses`` one whose resting rows make no free guesses
(``Speculation(wake_hits=0)``: the rest rule before them), same run. Writes ``bench/results/speculative.md`` for the default model,
``speculative-NAME.md`` for another. Targets: edit >= 2.5x, Claude Code turn >= 1.5x, open
chat >= 0.95x.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("MLX_MESH_LOOP_GUARD", "0")  # like for like: answers run their course
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results" / "speculative.md"
DEFAULT_MODEL = Path.home() / ".mlx-mesh" / "models" / "smollm2-135m"
# The agent edit's files, as they were at EDIT_REVISION: the workload stays the same prompt when
# the tree moves on (the worker's rooms moved and the engine's files changed after it).
EDIT_REVISION = "1127247"
EDIT_FILES = [
    "worker/engine_commits.py",
    "worker/sampling.py",
    "worker/speculative.py",
    "worker/engine_ends.py",
]
TARGETS = {"agent edit": 2.5, "Claude Code turn": 1.5, "open chat": 0.95}


def edit_messages(path: str) -> list[dict[str, Any]]:
    text = subprocess.run(
        ["git", "show", f"{EDIT_REVISION}:{path}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    lines = text.splitlines()[:110]
    body = "\n".join(lines)
    ask = (
        f"Here is {path}:\n\n```python\n{body}\n```\n\nReturn the whole file with one change: "
        "rename the variable `cache` to `kv_cache` everywhere. Reply with the file only."
    )
    return [{"role": "user", "content": ask}]


def claude_code_prompt(engine: Any) -> list[int]:
    """The captured Claude Code request (tests/fixtures/claude_code_requests.json: it hands a
    Bash result back) as the worker renders it when a node forwards it: the gateway's
    Anthropic parse, the worker body, the worker's chat prompt with the tools listed as fully
    as the context allows (Claude Code sends 25 tools)."""
    from gateway.api.messages import parse
    from gateway.worker_client import worker_body
    from worker.chat.job import fitted_prompt
    from worker.chat.prompt import ChatTemplate
    from worker.chat.schemas import ChatCompletionRequest

    data = json.loads((ROOT / "tests" / "fixtures" / "claude_code_requests.json").read_text())
    chat, _ = parse(data["tool_result"]["body"])
    request = ChatCompletionRequest.model_validate(worker_body(chat, "model"))
    messages = [m.to_template() for m in request.messages]
    tools = [t.model_dump(exclude_none=True) for t in request.tools or []] or None
    (prompt, _), _ = fitted_prompt(
        ChatTemplate(engine.tokenizer), engine.info.context_length, messages, tools, {}
    )
    return prompt


OPEN_CHAT = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain why the sky is blue to a ten-year-old.",
    "Give me three ideas for a birthday party in winter.",
    "Describe a walk through a busy market in the morning.",
]


async def stream(engine: Any, request: Any) -> tuple[float | None, float, int, str]:
    from worker.engine.types import Finished, TokenChunk

    job = engine.submit(request)
    first, tokens, text = None, 0, []
    async for event in job.events():
        if isinstance(event, TokenChunk):
            text.append(event.text)
            if first is None:
                first, tokens = time.perf_counter(), event.completion_tokens
        elif isinstance(event, Finished):
            engine.commit(job)
            return first, time.perf_counter(), event.completion_tokens - tokens, "".join(text)
    raise RuntimeError("no terminal event")


async def measure(engine: Any, requests: list[Any]) -> tuple[int, float, dict[str, Any], list[str]]:
    """Decode tokens and seconds of ``requests`` run together, what speculation did meanwhile,
    the answers."""
    stats = engine.speculation
    before = (stats.drafted, stats.accepted, stats.verify_steps, stats.emitted, stats.row_steps)
    results = await asyncio.gather(*(stream(engine, r) for r in requests))
    after = (stats.drafted, stats.accepted, stats.verify_steps, stats.emitted, stats.row_steps)
    counts = dict(
        zip(("drafted", "accepted", "verify_steps", "emitted", "row_steps"),
            (a - b for a, b in zip(after, before, strict=True)), strict=True)
    )  # fmt: skip
    starts = [f for f, _, _, _ in results if f is not None]
    span = max(e for _, e, _, _ in results) - min(starts)
    tokens = sum(n for _, _, n, _ in results)
    return tokens, span, counts, [text for _, _, _, text in results]


def summarise(trials: list[dict[str, Any]], mode: str) -> dict[str, Any]:
    """A row's trials: median tok/s each side, the median of the paired ratios, counters."""
    off = [t["off"][0] for t in trials]
    on = [t[mode][0] for t in trials]
    ratios = [b / a for a, b in zip(off, on, strict=True) if a]
    counts = {k: sum(t[mode][1][k] for t in trials) for k in trials[0][mode][1]}
    return {
        "off": statistics.median(off),
        "on": statistics.median(on),
        "ratio": statistics.median(ratios) if ratios else float("nan"),
        "low": min(ratios, default=float("nan")),
        "high": max(ratios, default=float("nan")),
        "acceptance": counts["accepted"] / counts["drafted"] if counts["drafted"] else None,
        "per_step": counts["emitted"] / counts["row_steps"] if counts["row_steps"] else None,
        "verify_steps": counts["verify_steps"],
    }


def verify_cost(model_dir: str) -> list[tuple[int, int, float]]:
    """Seconds of one forward pass of B rows x W tokens on a 512-token batch cache."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache, KVCache

    from worker.engine.load import load_model
    from worker.engine.types import EngineConfig

    model, _, _, _ = load_model(model_dir, None, EngineConfig())
    rows = []
    for b in (1, 2, 4, 8):
        for w in (1, 5, 9):
            layers = [KVCache() for _ in model.layers]
            model(mx.array([list(range(10, 522))]), cache=layers)
            batch = [BatchKVCache.merge([c] * b) for c in layers]
            times = []
            for _ in range(4):
                t = time.perf_counter()
                out = model(mx.array([[5] * w] * b), cache=batch)
                mx.eval(out)
                times.append(time.perf_counter() - t)
                for c in batch:
                    c.trim(w)
            rows.append((b, w, min(times)))
    return rows


def workload_prompts(engine: Any, chosen: list[str]) -> dict[str, list[list[int]]]:
    from worker.chat.prompt import ChatTemplate

    template = ChatTemplate(engine.tokenizer)
    chat = {
        "agent edit": [edit_messages(p) for p in EDIT_FILES],
        "open chat": [[{"role": "user", "content": q}] for q in OPEN_CHAT],
    }
    prompts = {
        name: [template.render(m, None, {})[0] for m in items] for name, items in chat.items()
    }
    if "Claude Code turn" in chosen:
        prompts["Claude Code turn"] = [claude_code_prompt(engine)]
    return {name: prompts[name] for name in chosen if name in prompts}


async def run_row(
    engines: dict[str, Any], items: list[list[int]], temperature: float, streams: int, args: Any
) -> tuple[list[dict[str, Any]], list[int], str]:
    """``args.trials`` runs of one row on every engine, who goes first alternating (a slow
    minute hits both sides); the baseline's answers give the lookup ceiling."""
    from worker.engine.types import GenerationRequest
    from worker.sampling import SamplingParams
    from worker.speculative.policy import lookup_ceiling

    tokenizer = engines["off"].tokenizer
    trials: list[dict[str, Any]] = []
    ceiling = [0, 0]  # answer tokens, passes
    answers: list[str] = []
    for trial in range(args.trials):
        order = list(engines.items())[:: -1 if trial % 2 else 1]
        results = {}
        for mode, engine in order:
            # Every item once at least: with fewer streams than items, rounds of ``streams``
            # one after another (one stream runs each edit in turn, not the first alone).
            rounds = -(-len(items) // streams)
            requests, texts, tokens, span = [], [], 0, 0.0
            counts: dict[str, Any] = {}
            for r in range(rounds):
                batch = [
                    GenerationRequest(
                        items[(r * streams + i) % len(items)],
                        args.max_tokens,
                        SamplingParams(temperature=temperature, seed=i + 100 * trial),
                    )
                    for i in range(streams)
                ]
                n, seconds, got, answers_of = await measure(engine, batch)
                requests += batch
                texts += answers_of
                tokens, span = tokens + n, span + seconds
                counts = {k: counts.get(k, 0) + v for k, v in got.items()}
            tok_s = tokens / span if span > 0 else 0.0
            results[mode] = (tok_s, counts)
            print(temperature, streams, trial, mode, round(tok_s, 2), counts, flush=True)
            if mode != "off":
                continue
            answers = answers or texts
            for request, text in zip(requests, texts, strict=True):
                answer = tokenizer.encode(text, add_special_tokens=False)
                n, passes = lookup_ceiling(request.prompt, answer)
                ceiling[0] += n
                ceiling[1] += passes
        trials.append(results)
    return trials, ceiling, answers[0]


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--out", help="results file (default: by model, see results_path)")
    parser.add_argument(
        "--draft-model", help="also run an engine drafting with this model (a third column)"
    )
    parser.add_argument(
        "--workloads", default="agent edit,Claude Code turn,open chat", help="comma-separated"
    )
    parser.add_argument(
        "--without-guesses",
        action="store_true",
        help="also run an engine whose resting rows make no free guesses (a third column)",
    )
    parser.add_argument("--streams", default="1,4", help="comma-separated")
    parser.add_argument("--no-costs", action="store_true", help="skip the verify-cost table")
    parser.add_argument(
        "--trials", type=int, default=3, help="runs of each row, off and on alternating first"
    )
    args = parser.parse_args()
    from worker.engine.core import Engine
    from worker.engine.types import EngineConfig
    from worker.speculative.policy import Speculation

    configs = {"off": EngineConfig(speculation=Speculation(mode="off")), "auto": EngineConfig()}
    if args.draft_model:
        configs["draft"] = EngineConfig(draft_model=args.draft_model)
    if args.without_guesses:
        configs["no guesses"] = EngineConfig(speculation=Speculation(wake_hits=0))
    engines = {}
    for mode, config in configs.items():
        engine = Engine(args.model, name=mode, config=config)
        engine.start(timeout=600)
        engines[mode] = engine
    prompts = workload_prompts(engines["off"], args.workloads.split(","))
    print({name: [len(p) for p in items] for name, items in prompts.items()}, flush=True)
    rows = []
    for name, items in prompts.items():
        for temperature in (0.0, 0.7):
            for streams in (int(n) for n in args.streams.split(",")):
                trials, ceiling, answer = await run_row(engines, items, temperature, streams, args)
                rows.append((name, temperature, streams, trials, ceiling, answer))
    for engine in engines.values():
        engine.close()
    costs = [] if args.no_costs else verify_cost(args.model)
    write(rows, costs, args)


def results_path(args: Any) -> Path:
    """bench/results/speculative.md for the default model, speculative-NAME.md for another."""
    if args.out:
        return Path(args.out)
    name = Path(args.model).name
    return RESULTS if name == DEFAULT_MODEL.name else RESULTS.with_name(f"speculative-{name}.md")


def command_flags(args: Any) -> str:
    flags = f"--max-tokens {args.max_tokens} --trials {args.trials}"
    if Path(args.model).name != DEFAULT_MODEL.name:
        flags += f" --model {args.model}"
    if args.draft_model:
        flags += f" --draft-model {args.draft_model}"
    if args.without_guesses:
        flags += " --without-guesses"
    return flags


def sections_of(args: Any) -> dict[str, str]:
    """A table per speculating engine: its mode → the table's title."""
    sections = {"auto": "Prompt lookup (`--speculation auto`)"}
    if args.draft_model:
        sections["draft"] = f"Draft model `{Path(args.draft_model).name}` (`--draft-model`)"
    if args.without_guesses:
        sections["no guesses"] = "Prompt lookup, resting rows without free guesses (the A/B)"
    return sections


def write(rows: list[Any], costs: list[tuple[int, int, float]], args: Any) -> None:
    flags = command_flags(args)
    out = [
        "# Speculative decoding: same engine, speculation off vs auto",
        "",
        f"`nice -n 5 python bench/speculative.py {flags}` on "
        f"{platform.machine()} {platform.system()} (shared box: same-run ratios only), "
        f"model `{Path(args.model).name}`, CPU backend. Decode tok/s after the first token, all "
        f"streams together, median of {args.trials} trials (off and on alternating first); "
        "× is the median of the trials' paired ratios, its range after it. Acceptance: accepted "
        "/ drafted tokens; per step: tokens a verify pass gave a row (1 = plain decoding). "
        "Lookup ceiling: tokens a pass would give if every pass drafted 8 tokens by prompt "
        "lookup and kept those the baseline's own answer has – what the answer allows at any "
        "cost of a pass (1.0: it copies nothing from its context).",
    ]
    for mode, title in sections_of(args).items():
        out += [
            "",
            f"## {title}",
            "",
            "| workload | temp | streams | off tok/s | on tok/s | × | × range | target | "
            "acceptance | tokens/verify step | verify steps | lookup ceiling |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name, temperature, streams, trials, ceiling, _ in rows:
            row = summarise(trials, mode)
            acc, per = row["acceptance"], row["per_step"]
            limit = ceiling[0] / ceiling[1] if ceiling[1] else float("nan")
            out.append(
                f"| {name} | {temperature} | {streams} | {row['off']:.2f} | {row['on']:.2f} | "
                f"{row['ratio']:.2f} | {row['low']:.2f}-{row['high']:.2f} | ≥ {TARGETS[name]} | "
                f"{'-' if acc is None else f'{acc:.2f}'} | "
                f"{'-' if per is None else f'{per:.2f}'} | {row['verify_steps']} | {limit:.2f} |"
            )
    out += ["", "## What the model wrote (first stream, first trial, speculation off)", ""]
    for name, temperature, streams, _, _, answer in rows:
        if streams == 1:
            shown = answer[:240].replace("\n", "⏎").replace("|", "\\|").replace("`", "'")
            out.append(f"- {name}, temperature {temperature}: `{shown}`")
    if costs:
        out += [
            "",
            "## Cost of a verify pass (B rows × W tokens each, 512 tokens cached)",
            "",
            "| rows | 1 token | 5 tokens | 9 tokens |",
            "|---|---|---|---|",
        ]
        by_rows: dict[int, dict[int, float]] = {}
        for b, w, seconds in costs:
            by_rows.setdefault(b, {})[w] = seconds
        for b, widths in by_rows.items():
            cells = " | ".join(f"{widths[w] * 1000:.0f} ms" for w in (1, 5, 9))
            out.append(f"| {b} | {cells} |")
    results_path(args).write_text("\n".join(out) + "\n")
    print("\n".join(out))


if __name__ == "__main__":
    asyncio.run(main())
