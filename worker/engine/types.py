"""What goes into and comes out of the engine: requests, job events, config, stats, model facts."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from worker.engine.loop_guard import configured_span
from worker.prompt_cache.disk import DiskTierConfig
from worker.sampling import SamplingParams
from worker.speculative.policy import Speculation

DEFAULT_CONTEXT_LENGTH = 4096
SPECULATION_MODES = ("auto", "off")
SPECULATION_HELP = (
    "speculative decoding: auto drafts from each request's prompt and answer and checks the"
    " drafts in one forward pass, per row while they are accepted; off decodes a token a step"
)

DRAFT_MODEL_HELP = (
    "a small model of the same tokenizer (store name, MLX directory or hub id) that drafts the"
    " tokens speculation checks, instead of prompt lookup"
)


class EngineError(Exception):
    """The engine cannot serve (model failed to load, shut down)."""


@dataclass(frozen=True, slots=True)
class EngineConfig:
    prompt_cache_bytes: int = 2 << 30
    # One memory budget for running KV, pending commits and the prompt cache's memory tier
    # (worker/engine/budget.py): None 80 % of physical memory less the weights; 0 none.
    memory_budget_bytes: int | None = None
    # The prompt cache's disk tier (worker/prompt_cache/disk.py); None: memory only.
    prompt_cache_disk: DiskTierConfig | None = None
    commit_wait_s: float = 2.0  # a job waiting for a pending commit proceeds without it after this
    pending_commit_ttl_s: float = 30.0  # a commit never requested is dropped after this
    # An answer's cache is brought to the next turn's tokens when they add at most this many
    # (worker/engine/next_turns.py); 0: never.
    next_turn_max_tail: int = 512
    # An idle engine that gets a job waits this long for the next before it prefills (each
    # arrival restarts the wait, up to admit_window_s): requests sent together reach it a
    # millisecond or two apart, and one that misses the first's prefill waits a whole one.
    admit_gap_s: float = 0.003
    admit_window_s: float = 0.010
    completion_batch_size: int = 16
    prefill_batch_size: int = 8
    prefill_step_size: int = 512
    # False serves jobs one at a time even when the model's cache could be batched.
    batching: bool = True
    # A job whose prompt shares a prefix with a running job's starts from a copy of that job's
    # KV instead of prefilling it again (worker/engine/shared_prefill.py): the samples of one prompt
    # cost one prefill. It waits for the other's prefill only when at least this many tokens
    # (and half its own prefill) are shared.
    share_prefill: bool = True
    share_prefill_min_tokens: int = 16
    # On the CPU backend, run float16/bfloat16 weights as float32: x86 CPUs emulate half
    # precision, which made a 135M model ~30x slower per layer. Packed quantized weights stay.
    cpu_float32: bool = True
    # On the CPU backend, unpack quantized weights to float32 when the float32 model takes at
    # most this share of physical memory: MLX's CPU quantized_matmul runs at ~2 GFLOP/s, a
    # float32 matmul on OpenBLAS at ~85 (see worker/cpu/fast_path.py). 0 keeps them quantized.
    cpu_dequantize_share: float = 0.25
    # End an answer whose last this-many tokens are one block repeated (worker.engine.loop_guard);
    # 0 turns it off.
    loop_guard_tokens: int = field(default_factory=configured_span)
    # Speculative decoding in the batch (worker/speculative/): "auto" drafts from each
    # request's prompt and answer (prompt lookup) and verifies the drafts in one forward pass,
    # row by row while acceptance holds and while the batch is small; "off" decodes one token
    # a step. The width, the rows, the cost model and the rests are its fields.
    speculation: Speculation = field(default_factory=Speculation)
    # A small model of the same tokenizer that drafts instead of prompt lookup (an MLX
    # directory or hub id: worker/speculative/drafts.py); None: prompt lookup.
    draft_model: str | None = None


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    # With ``logprobs``: how many of the most likely tokens each position also reports (0-20).
    top_logprobs: int = 0
    request_id: str | None = None
    # Run after the sampling ones, each request its own (a grammar's, worker/structured/processor.py).
    logits_processors: tuple[Any, ...] = ()


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A generated token's text and log-probability, and the ``top_logprobs`` most likely
    tokens at its position (text, log-probability), most likely first."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True, slots=True)
class TokenChunk:
    """Text decoded since the previous chunk (stop strings already removed)."""

    text: str
    logprobs: list[TokenLogprob] | None = None
    completion_tokens: int = 0  # generated so far, this chunk's tokens included
    cached_tokens: int = 0  # of the prompt, read from the prompt cache (known from the start)


@dataclass(frozen=True, slots=True)
class Finished:
    finish_reason: str  # "stop" | "length"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    # The request's stop string that ended generation; None for EOS, length or no stop hit.
    stop_sequence: str | None = None


@dataclass(frozen=True, slots=True)
class Failed:
    message: str


JobEvent = TokenChunk | Finished | Failed


class Job:
    """One submitted generation; iterate ``events()`` for TokenChunk… then Finished or Failed."""

    def __init__(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop) -> None:
        self.id = request.request_id or uuid.uuid4().hex
        self.request = request
        self._loop = loop
        self._queue: asyncio.Queue[JobEvent] = asyncio.Queue()
        self.done = False  # a terminal event was delivered to the consumer

    def _deliver(self, event: JobEvent) -> bool:
        """Owner thread → event loop. False when the loop is gone (the consumer cannot read)."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)
        except RuntimeError:
            return False
        return True

    def has_ready(self) -> bool:
        """Whether an event is already waiting (the consumer can batch its writes)."""
        return not self._queue.empty()

    async def events(self) -> AsyncIterator[JobEvent]:
        while True:
            event = await self._queue.get()
            if isinstance(event, Finished | Failed):
                self.done = True
                yield event
                return
            yield event


@dataclass
class EngineStats:
    """Counters read by /health and tests. ``events`` keeps the recent (kind, job_id) order."""

    queue_depth: int = 0  # submitted, no token yet
    in_flight: int = 0  # producing tokens
    submitted: int = 0
    completed: int = 0
    cancelled: int = 0
    generated_tokens: int = 0
    commits: int = 0
    commit_waits: int = 0
    commit_wait_timeouts: int = 0
    next_turns: int = 0  # answers' caches brought to their next turn's tokens (next_turns.py)
    loops_stopped: int = 0  # answers the loop guard ended
    # Prefill work: jobs that ran more than their last prompt token through the model, and the
    # prompt tokens run (the last one of each job included); jobs that started from a running
    # sibling's KV (worker/engine/shared_prefill.py) and the prompt tokens they took from it.
    prefills: int = 0
    prompt_tokens_computed: int = 0
    shared_prefills: int = 0
    shared_prefill_tokens: int = 0
    # The start-up warm-up (Engine.warm_up): how long it took and the tokens it generated.
    warm_up_s: float | None = None
    warm_up_tokens: int = 0
    events: deque[tuple[str, str]] = field(default_factory=lambda: deque(maxlen=1000))
    _events_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def log(self, kind: str, job_id: str) -> None:
        with self._events_lock:
            self.events.append((kind, job_id))

    def events_for(self, job_id: str) -> list[str]:
        with self._events_lock:
            return [kind for kind, jid in self.events if jid == job_id]


@dataclass(frozen=True, slots=True)
class LoadedModel:
    architecture: str = "unknown"
    parameters: int = 0
    context_length: int = DEFAULT_CONTEXT_LENGTH
    quantization: str = "none"
    loaded_at: float = field(default_factory=time.time)

    @classmethod
    def from_config(cls, config: dict[str, Any], model: Any) -> LoadedModel:
        text = config.get("text_config") or {}
        context = None
        for key in ("max_position_embeddings", "max_seq_len", "n_ctx", "seq_length"):
            context = config.get(key) or text.get(key)
            if context:
                break
        quant = config.get("quantization") or config.get("quantization_config") or {}
        bits = quant.get("bits") if isinstance(quant, dict) else None
        if bits:
            quantization = f"q{bits}"
        else:
            quantization = str(config.get("torch_dtype") or config.get("dtype") or "none")
        return cls(
            architecture=str(config.get("model_type", "unknown")),
            parameters=_count_parameters(model, bits),
            context_length=int(context or DEFAULT_CONTEXT_LENGTH),
            quantization=quantization,
        )


def _count_parameters(model: Any, bits: int | None) -> int:
    from mlx.utils import tree_flatten

    total = 0
    for name, array in tree_flatten(model.parameters()):
        if name.endswith((".scales", ".biases")):
            continue
        size = int(array.size)
        if bits and str(array.dtype) == "mlx.core.uint32":
            size = size * 32 // bits
        total += size
    return total
