"""Benchmark: speculative decoding (prompt lookup) against the same engine with it off.

One process, two engines on the same model (``EngineConfig.speculation`` "off" = baseline,
"auto"), each workload run on both in turn, in the same run. Workloads (issue 24):

- agent edit: a 60-120-line file of this repository, returned with one change;
- Claude Code turn: the captured request that hands a Bash result back
  (tests/fixtures/claude_code_requests.json), its tools and messages rendered as text;
- open chat: a question whose answer shares nothing with the prompt.

Temperature 0 and 0.7 (seeded), 1 and 4 concurrent streams. Decode tok/s = completion tokens
after each stream's first token / the time from the first stream's first token to the last
stream's end. Also: acceptance and tokens per verify step (the engine's counters), and the
cost of a verify pass by batch rows and width (what the ``speculation_max_rows`` default rests
on). The box is shared: only same-run ratios mean anything.

    nice -n 5 python bench/speculative.py [--model DIR] [--max-tokens 96] [--draft-model DIR]
        [--workloads "agent edit,open chat"] [--streams 1,4] [--no-costs] [--out FILE]

``--draft-model`` adds a third engine that drafts with that model (same tokenizer) and a
table of its own. Writes ``bench/results/speculative.md`` for the default model,
``speculative-NAME.md`` for another. Targets: edit >= 2.5x, Claude Code turn >= 1.5x, open
chat >= 0.95x.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("MLX_MESH_LOOP_GUARD", "0")  # like for like: answers run their course
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results" / "speculative.md"
DEFAULT_MODEL = Path.home() / ".mlx-mesh" / "models" / "smollm2-135m"
EDIT_FILES = [
    "worker/engine_commits.py",
    "worker/sampling.py",
    "worker/speculative.py",
    "worker/engine_ends.py",
]
TARGETS = {"agent edit": 2.5, "Claude Code turn": 1.5, "open chat": 0.95}


def edit_messages(path: str) -> list[dict[str, Any]]:
    text = (ROOT / path).read_text()
    lines = text.splitlines()[:110]
    body = "\n".join(lines)
    ask = (
        f"Here is {path}:\n\n```python\n{body}\n```\n\nReturn the whole file with one change: "
        "rename the variable `cache` to `kv_cache` everywhere. Reply with the file only."
    )
    return [{"role": "user", "content": ask}]


def claude_code_turn() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The captured Anthropic request as plain chat messages and OpenAI-style tools."""
    data = json.loads((ROOT / "tests" / "fixtures" / "claude_code_requests.json").read_text())
    body = data["tool_result"]["body"]
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    if system:
        text = system if isinstance(system, str) else "\n".join(b.get("text", "") for b in system)
        messages.append({"role": "system", "content": text})
    for message in body["messages"]:
        content = message["content"]
        if isinstance(content, str):
            messages.append({"role": message["role"], "content": content})
            continue
        parts = []
        for block in content:
            kind = block.get("type")
            if kind == "text":
                parts.append(block["text"])
            elif kind == "tool_use":
                parts.append(json.dumps({"name": block["name"], "arguments": block["input"]}))
            elif kind == "tool_result":
                inner = block.get("content")
                if isinstance(inner, list):
                    inner = "\n".join(b.get("text", "") for b in inner)
                parts.append(str(inner))
        messages.append({"role": message["role"], "content": "\n".join(parts)})
    # SmolLM2 holds 8,192 tokens and Claude Code sends ~20 tools: the turn's own tool (Bash)
    # and two more, descriptions cut to 400 characters, keep it a ~2,000-token prompt.
    used = {"Bash", "Read", "Edit"}
    tools = [
        {"type": "function", "function": {"name": t["name"], "description": t.get("description",
         "")[:400], "parameters": t.get("input_schema", {})}}
        for t in body.get("tools", []) if t["name"] in used
    ]  # fmt: skip
    return messages, tools


OPEN_CHAT = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain why the sky is blue to a ten-year-old.",
    "Give me three ideas for a birthday party in winter.",
    "Describe a walk through a busy market in the morning.",
]


async def stream(engine: Any, request: Any) -> tuple[float | None, float, int]:
    from worker.engine_types import Finished, TokenChunk

    job = engine.submit(request)
    first, tokens = None, 0
    async for event in job.events():
        if isinstance(event, TokenChunk) and first is None:
            first, tokens = time.perf_counter(), event.completion_tokens
        elif isinstance(event, Finished):
            engine.commit(job)
            return first, time.perf_counter(), event.completion_tokens - tokens
    raise RuntimeError("no terminal event")


async def measure(engine: Any, requests: list[Any]) -> tuple[float, dict[str, Any]]:
    """Decode tok/s of ``requests`` run together, and what speculation did meanwhile."""
    stats = engine.speculation
    before = (stats.drafted, stats.accepted, stats.verify_steps, stats.emitted, stats.row_steps)
    results = await asyncio.gather(*(stream(engine, r) for r in requests))
    after = (stats.drafted, stats.accepted, stats.verify_steps, stats.emitted, stats.row_steps)
    drafted, accepted, steps, emitted, row_steps = (
        a - b for a, b in zip(after, before, strict=True)
    )
    starts = [f for f, _, _ in results if f is not None]
    span = max(e for _, e, _ in results) - min(starts)
    tok_s = sum(n for _, _, n in results) / span if span > 0 else 0.0
    return tok_s, {
        "acceptance": accepted / drafted if drafted else None,
        "verify_steps": steps,
        "per_step": emitted / row_steps if row_steps else None,
    }


def verify_cost(model_dir: str) -> list[tuple[int, int, float]]:
    """Seconds of one forward pass of B rows x W tokens on a 512-token batch cache."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache, KVCache

    from worker.engine_load import load_model
    from worker.engine_types import EngineConfig

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
    parser.add_argument("--streams", default="1,4", help="comma-separated")
    parser.add_argument("--no-costs", action="store_true", help="skip the verify-cost table")
    args = parser.parse_args()
    from worker.engine import Engine
    from worker.engine_types import EngineConfig, GenerationRequest
    from worker.sampling import SamplingParams

    configs = {"off": EngineConfig(speculation="off"), "auto": EngineConfig(speculation="auto")}
    if args.draft_model:
        configs["draft"] = EngineConfig(speculation="auto", draft_model=args.draft_model)
    engines = {}
    for mode, config in configs.items():
        engine = Engine(args.model, name=mode, config=config)
        engine.start(timeout=600)
        engines[mode] = engine
    tokenizer_engine = engines["off"]
    cc_messages, cc_tools = claude_code_turn()
    workloads = {
        "agent edit": [(edit_messages(p), None) for p in EDIT_FILES],
        "Claude Code turn": [(cc_messages, cc_tools)],
        "open chat": [([{"role": "user", "content": q}], None) for q in OPEN_CHAT],
    }
    chosen = args.workloads.split(",")
    prompts = {
        name: [tokenizer_engine.render_prompt(m, t, {})[0] for m, t in items]
        for name, items in workloads.items()
        if name in chosen
    }
    print({name: [len(p) for p in items] for name, items in prompts.items()}, flush=True)
    rows = []
    for name, items in prompts.items():
        for temperature in (0.0, 0.7):
            for streams in (int(n) for n in args.streams.split(",")):
                results = {}
                for mode, engine in engines.items():
                    requests = [
                        GenerationRequest(
                            items[i % len(items)],
                            args.max_tokens,
                            SamplingParams(temperature=temperature, seed=i),
                        )
                        for i in range(streams)
                    ]
                    tok_s, counts = await measure(engine, requests)
                    results[mode] = (tok_s, counts)
                    print(name, temperature, streams, mode, round(tok_s, 2), counts, flush=True)
                rows.append((name, temperature, streams, results))
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


def write(rows: list[Any], costs: list[tuple[int, int, float]], args: Any) -> None:
    flags = f"--max-tokens {args.max_tokens}"
    if Path(args.model).name != DEFAULT_MODEL.name:
        flags += f" --model {args.model}"
    if args.draft_model:
        flags += f" --draft-model {args.draft_model}"
    out = [
        "# Speculative decoding: same engine, speculation off vs auto",
        "",
        f"`nice -n 5 python bench/speculative.py {flags}` on "
        f"{platform.machine()} {platform.system()} (shared box: same-run ratios only), "
        f"model `{Path(args.model).name}`, CPU backend. Decode tok/s after the first token, all "
        "streams together. Acceptance: accepted / drafted tokens; per step: tokens a verify pass "
        "gave a row (1 = plain decoding).",
    ]
    sections = {"auto": "Prompt lookup (`--speculation auto`)"}
    if args.draft_model:
        sections["draft"] = f"Draft model `{Path(args.draft_model).name}` (`--draft-model`)"
    for mode, title in sections.items():
        out += [
            "",
            f"## {title}",
            "",
            "| workload | temp | streams | off tok/s | on tok/s | × | target | acceptance | "
            "tokens/verify step | verify steps |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name, temperature, streams, results in rows:
            off, on = results["off"][0], results[mode][0]
            counts = results[mode][1]
            ratio = on / off if off else float("nan")
            acc, per = counts["acceptance"], counts["per_step"]
            out.append(
                f"| {name} | {temperature} | {streams} | {off:.2f} | {on:.2f} | {ratio:.2f} | "
                f"≥ {TARGETS[name]} | {'-' if acc is None else f'{acc:.2f}'} | "
                f"{'-' if per is None else f'{per:.2f}'} | {counts['verify_steps']} |"
            )
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
