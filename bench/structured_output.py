"""Benchmark: decode speed with and without a JSON schema (structured output, issue 13).

One process, the worker's ``Engine`` per model (what the worker serves: BatchGenerator, the CPU
fast path), greedy, every case run ``--rounds`` times round-robin; the report gives each case's
best and median run and their ratios against the unconstrained baseline of the same run:

- ``free``: one request, no schema (the baseline);
- ``schema``: one request held to a schema that cannot end before ``--tokens`` (64 strings of
  8-16 characters), so both run to the same length;
- ``batch_free``: three requests without a schema at once (the batch baseline);
- ``batch_mixed``: two requests with different schemas and one without, at once. A batch
  decodes its requests in the same steps, so all three have one speed: against ``batch_free``
  it is what a request without a schema pays for sharing a batch with grammars.

Also timed: the grammar's own work per step (inside the processor, once the sampled token is
there), the one-off cost of the model's llguidance tokenizer, and a matcher's compile time.
Decode tok/s is (tokens - 1) / (last token - first token) of each request.

Models: the tiny random-weight test model, plus ``~/.mlx-mesh/models/smollm2-135m`` when present
(or each ``--model DIR``). Writes ``bench/results/structured-output.md``.

    python bench/structured_output.py [--model DIR ...] [--rounds 4] [--tokens 128]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results" / "structured-output.md"
SMOLLM2 = Path.home() / ".mlx-mesh" / "models" / "smollm2-135m"
QUESTION = "List sixty-four short names of European towns, as JSON."
LONG = {  # cannot end before the token limit: both cases run to the same length
    "type": "object",
    "properties": {
        "towns": {
            "type": "array",
            "items": {"type": "string", "minLength": 8, "maxLength": 16},
            "minItems": 64,
            "maxItems": 64,
        }
    },
    "required": ["towns"],
    "additionalProperties": False,
}
NESTED = {
    "type": "object",
    "properties": {
        "rows": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 0, "maximum": 99999},
                    "kind": {"enum": ["alpha", "beta", "gamma"]},
                    "label": {"type": "string", "minLength": 4, "maxLength": 12},
                },
                "required": ["id", "kind", "label"],
                "additionalProperties": False,
            },
            "minItems": 40,
            "maxItems": 40,
        }
    },
    "required": ["rows"],
    "additionalProperties": False,
}
CASES = ("free", "schema", "batch_free", "batch_mixed")


class TimedProcessor:
    """The request's grammar processor, timed: waits for the sampled token first (the engine
    waits for it anyway), then times what the grammar itself adds per step (consume the token,
    compute the mask, build the masked logits)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.spent_s = 0.0
        self.calls = 0

    def __call__(self, tokens: Any, logits: Any) -> Any:
        import mlx.core as mx

        mx.eval(tokens)
        started = time.perf_counter()
        out = self.inner(tokens, logits)
        self.spent_s += time.perf_counter() - started
        self.calls += 1
        return out


@dataclass
class Timed:
    tokens: int
    ttft_s: float
    decode_tps: float
    finish: str
    grammar_us: float | None = None  # grammar work per step


@dataclass
class ModelResult:
    name: str
    tokenizer_build_s: float
    compile_ms: dict[str, float]
    runs: dict[str, list[dict[str, float]]] = field(default_factory=dict)


async def _one(engine: Any, prompt: list[int], tokens: int, schema: dict[str, Any] | None) -> Timed:
    from worker.engine.types import Finished, GenerationRequest, TokenChunk
    from worker.sampling import SamplingParams
    from worker.structured.json_grammar import json_grammar
    from worker.structured.processor import make_grammar_processor

    started = time.perf_counter()
    processors: tuple[TimedProcessor, ...] = ()
    if schema is not None:
        grammar = json_grammar(schema)
        inner = await asyncio.to_thread(make_grammar_processor, engine.tokenizer, grammar)
        processors = (TimedProcessor(inner),)
    job = engine.submit(
        GenerationRequest(
            prompt=prompt,
            max_tokens=tokens,
            sampling=SamplingParams(temperature=0.0),
            logits_processors=processors,
        )
    )
    first = last = None
    count, finish = 0, "?"
    async for event in job.events():
        now = time.perf_counter()
        if isinstance(event, TokenChunk):
            first = first or now
            last, count = now, event.completion_tokens
        elif isinstance(event, Finished):
            count, finish = event.completion_tokens, event.finish_reason
    engine.commit(job)
    assert first is not None and last is not None and count > 1, "no tokens"
    grammar_us = None
    if processors:
        grammar_us = processors[0].spent_s / max(processors[0].calls, 1) * 1e6
    return Timed(count, first - started, (count - 1) / max(last - first, 1e-9), finish, grammar_us)


async def _case(engine: Any, prompt: list[int], tokens: int, case: str) -> dict[str, float]:
    if case == "free":
        t = await _one(engine, prompt, tokens, None)
        return {"tps": t.decode_tps, "ttft": t.ttft_s}
    if case == "schema":
        t = await _one(engine, prompt, tokens, LONG)
        assert t.finish == "length", f"the schema answer ended early ({t.finish})"
        assert t.grammar_us is not None
        return {"tps": t.decode_tps, "ttft": t.ttft_s, "grammar_us": t.grammar_us}
    # One batch: every request decodes in the same steps, so each has the same speed.
    schemas = [None, None, None] if case == "batch_free" else [LONG, NESTED, None]
    timed = await asyncio.gather(*(_one(engine, prompt, tokens, s) for s in schemas))
    return {"tps": statistics.mean(t.decode_tps for t in timed)}


def _prompt(engine: Any, round_: int) -> list[int]:
    from worker.chat.prompt import ChatTemplate

    # A different opening each round: every request prefills (no prompt-cache shortcut).
    messages = [{"role": "user", "content": f"({round_}) {QUESTION}"}]
    prompt, _ = ChatTemplate(engine.tokenizer).render(messages, None, {})
    return prompt


async def measure(path: Path, name: str, rounds: int, tokens: int) -> ModelResult:
    from worker.engine.core import Engine
    from worker.structured.json_grammar import json_grammar
    from worker.structured.processor import grammar_tokenizer, make_grammar_processor

    engine = Engine(str(path), name=name)
    engine.start(timeout=600)
    try:
        started = time.perf_counter()
        grammar_tokenizer(engine.tokenizer)
        build_s = time.perf_counter() - started
        compile_ms = {}
        for label, schema in (
            ("64 strings", LONG),
            ("40 nested rows", NESTED),
            ("any object", None),
        ):
            grammar = json_grammar(schema)
            started = time.perf_counter()
            make_grammar_processor(engine.tokenizer, grammar)
            compile_ms[label] = (time.perf_counter() - started) * 1e3
        result = ModelResult(name, build_s, compile_ms, {case: [] for case in CASES})
        await _case(engine, _prompt(engine, -1), 8, "batch_mixed")  # warm-up: kernels, caches
        for round_ in range(rounds):
            for case in CASES:
                prompt = _prompt(engine, round_ * len(CASES) + CASES.index(case))
                result.runs[case].append(await _case(engine, prompt, tokens, case))
                print(f"{name} round {round_ + 1} {case}: {result.runs[case][-1]}", flush=True)
        return result
    finally:
        engine.close()


def _stat(runs: list[dict[str, float]], key: str, best: bool) -> float:
    values = [r[key] for r in runs]
    return max(values) if best else statistics.median(values)


_LABELS = {
    "free": "one request, no schema (baseline)",
    "schema": "one request, schema",
    "batch_free": "batch of 3, no schema (each)",
    "batch_mixed": "batch of 2 schemas + 1 without (each)",
}


def render(results: list[ModelResult], args: argparse.Namespace, load: tuple[str, str]) -> str:
    import llguidance

    lines = [
        "# Structured output: decode speed with and without a JSON schema",
        "",
        "Written by `bench/structured_output.py`. One process; the worker's `Engine` per model "
        f"(BatchGenerator, CPU fast path), greedy, {args.tokens} tokens per request, "
        f"{args.rounds} rounds round-robin. The schema request's schema cannot end before the "
        "token limit, so both run to the same length. A batch decodes its requests in the same "
        "steps: each has the same speed, so the batch rows compare a batch with two grammars "
        "in it to one without (what a request without a schema pays for the company).",
        "",
        f"- machine: {platform.platform()}, {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}; load average {load[0]} at start, {load[1]} at the end",
        "- read with care: a shared 2-core machine where others run tests; each case's best run "
        "is the least disturbed one (others only slow a run down), the median is shown beside it",
        f"- {llguidance.get_version()}; schemas: 64 strings of 8-16 characters; 40 nested rows "
        "(integer, enum, string)",
        "",
        "| model | case | decode tok/s, best | × | median | × |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in results:
        for case in CASES:
            base_case = "batch_free" if case == "batch_mixed" else "free"
            best = _stat(r.runs[case], "tps", True)
            median = _stat(r.runs[case], "tps", False)
            best_x = best / _stat(r.runs[base_case], "tps", True)
            median_x = median / _stat(r.runs[base_case], "tps", False)
            base = " (vs batch of 3)" if case == "batch_mixed" else ""
            lines.append(
                f"| {r.name} | {_LABELS[case]} | {best:.1f} | {best_x:.2f}{base} | "
                f"{median:.1f} | {median_x:.2f} |"
            )
    lines += [
        "",
        "The grammar's own work per decode step (consume the sampled token, compute the mask, "
        "build the masked logits; timed inside the processor, after the token is there), against "
        "the step time of the best unconstrained run:",
        "",
    ]
    for r in results:
        grammar_us = statistics.median(run["grammar_us"] for run in r.runs["schema"])
        step_us = 1e6 / _stat(r.runs["free"], "tps", True)
        lines.append(
            f"- {r.name}: {grammar_us:.0f} µs per step, {grammar_us / step_us:.1%} of a "
            f"{step_us / 1e3:.1f} ms step"
        )
    lines += ["", "One-off costs (before the job is submitted, off the engine's thread):", ""]
    for r in results:
        compiles = ", ".join(f"{k} {v:.1f} ms" for k, v in r.compile_ms.items())
        lines.append(
            f"- {r.name}: llguidance tokenizer (the model's first schema request) "
            f"{r.tokenizer_build_s * 1e3:.0f} ms; matcher per request: {compiles}"
        )
    lines += ["", "## Every run (decode tok/s)", ""]
    for r in results:
        for case in CASES:
            cells = ", ".join(f"{run['tps']:.1f}" for run in r.runs[case])
            lines.append(f"- {r.name}, {_LABELS[case]}: {cells}")
    return "\n".join([*lines, ""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", type=Path, default=[])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    from worker.cpu.fast_path import reexec_with_fast_blas

    reexec_with_fast_blas()
    from worker.testing import make_tiny_model

    load_start = " ".join(f"{x:.2f}" for x in os.getloadavg())
    with tempfile.TemporaryDirectory() as tmp:
        models = [(p, p.name) for p in args.model]
        if not models:
            models = [(make_tiny_model(Path(tmp) / "tiny"), "tiny")]
            if SMOLLM2.is_dir():
                models.append((SMOLLM2, SMOLLM2.name))
        results = [asyncio.run(measure(p, n, args.rounds, args.tokens)) for p, n in models]
    load_end = " ".join(f"{x:.2f}" for x in os.getloadavg())
    RESULTS.write_text(render(results, args, (load_start, load_end)), encoding="utf-8")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
