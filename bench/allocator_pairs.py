"""One side of the allocator pair (bench/results/cpu.md, "Allocator"): load SmolLM2 into an
engine, run four 1,523-token prompts to 64 tokens, print the median TTFT and decode rate of the
last three and the RSS at the end. Run it alternately with ``MLX_MESH_MALLOC=off`` and without.

    python bench/allocator_pairs.py [--model DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from worker.chat.prompt import ChatTemplate
from worker.cpu.allocator import return_freed_memory
from worker.engine.core import Engine
from worker.engine.types import EngineConfig, Finished, GenerationRequest, TokenChunk
from worker.sampling import SamplingParams

DEFAULT_MODEL = str(Path.home() / ".mlx-mesh" / "models" / "smollm2-135m")


def rss_mib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS"):
            return int(line.split()[1]) // 1024
    return 0


async def one_prompt(engine: Engine, prompt: list[int]) -> tuple[float, float]:
    started, first, tokens = time.monotonic(), None, 0
    job = engine.submit(GenerationRequest(prompt, 64, SamplingParams(temperature=0.0)))
    async for event in job.events():
        if isinstance(event, TokenChunk) and first is None:
            first = time.monotonic()
        if isinstance(event, Finished):
            tokens = event.completion_tokens
    ended = time.monotonic()
    assert first is not None
    return first - started, tokens / (ended - first)


async def main(model: str, tuned: bool) -> str:
    engine = Engine(model, config=EngineConfig(prompt_cache_bytes=0))
    engine.start(timeout=120)
    template = ChatTemplate(engine.tokenizer)
    runs = []
    for rep in range(4):
        text = f"[{rep}] " + " ".join(f"word{i}" for i in range(400))
        prompt, _ = template.render([{"role": "user", "content": text}], None, {})
        runs.append(await one_prompt(engine, prompt))
    engine.close()
    ttft = statistics.median(r[0] for r in runs[1:])
    decode = statistics.median(r[1] for r in runs[1:])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    return (
        f"malloc={'tuned' if tuned else 'default'} prompt={len(prompt)} ttft_median={ttft:.3f}s"
        f" decode={decode:.1f}tok/s rss={rss_mib()}MiB maxrss={peak}MiB"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    args = parser.parse_args()
    tuned = return_freed_memory()  # first: before any thread makes an arena
    print(asyncio.run(main(args.model, tuned)), flush=True)
    os._exit(0)  # past MLX's teardown (see worker.serve.main.exit_process)
