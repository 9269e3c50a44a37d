"""The MLX engine: one owner thread runs the model; asyncio callers submit jobs and await tokens.

MLX streams are thread-local, so loading, prefill, decode and every KV-cache operation happen on
the owner thread. Callers talk to it through a command queue (submit, cancel, commit); tokens come
back through each job's asyncio queue via ``loop.call_soon_threadsafe``. The engine takes token
ids: rendering a conversation is the chat room's (worker/chat/prompt.py).

Concurrent jobs share the model through mlx-lm's ``BatchGenerator`` (continuous batching) when the
model's cache can be merged, else through ``SequentialGenerator`` (arrival order). Both advance
one step per call: a decoded token, or a prefill chunk of ``prefill_step_size`` prompt tokens.
Commands are drained between steps, so a cancel stops its job within one step, also a long
prompt's prefill within one chunk.

The engine keeps the thread, the inbox and the ends of jobs (finished, cancelled, rejected,
failed, shut down), each across the collaborators that own the state: the running rows on the
generator (worker/engine/rows.py), the jobs following a running row's prefill
(worker/engine/followers.py), and the prompt-cache commits that land *after* the response, with
the jobs parked until one they would reuse lands (worker/engine/commits.py). Loading is
worker/engine/load.py's.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from worker.cpu.fast_path import CpuFastPath
from worker.engine.commits import Commits
from worker.engine.followers import Followers
from worker.engine.inbox import Inbox
from worker.engine.load import Loader, can_batch, load_model, make_generator
from worker.engine.memory_gate import MemoryGate, memory_gate
from worker.engine.meter import Meter
from worker.engine.next_turns import NextTurns
from worker.engine.rows import Active, Rows
from worker.engine.types import (
    EngineConfig,
    EngineError,
    EngineStats,
    Failed,
    Finished,
    GenerationRequest,
    Job,
    JobEvent,
    LoadedModel,
    TokenChunk,
)
from worker.generation_config import MLX_LM_DEFAULTS, resolve_sampling_defaults
from worker.prompt_cache.digest import CacheDigest
from worker.prompt_cache.disk import DiskTier
from worker.prompt_cache.store import PromptCacheStats, PromptCacheStore
from worker.speculative.batch import SpeculationStats
from worker.speculative.drafts import DraftModel, make_draft

log = logging.getLogger(__name__)

__all__ = ["Engine", "EngineConfig", "EngineError", "GenerationRequest", "Job"]


class Engine:
    """Loads a model and serves generation jobs from one owner thread.

    ``generation_config_fallback``: the sampling to recommend when the model directory has no
    ``generation_config.json`` that names any (the store passes its registry entry's)."""

    def __init__(
        self,
        model_path: str,
        *,
        name: str | None = None,
        config: EngineConfig | None = None,
        generation_config_fallback: dict[str, Any] | None = None,
        loader: Loader | None = None,
    ) -> None:
        self.model_path = model_path
        # (model, tokenizer, config) from a path, on the owner thread; mlx_lm.load by default.
        # A split rank 0 passes its own (worker/serve/split_rank.py: lazy, only its layers).
        self._loader = loader
        self.name = name or model_path.rstrip("/").split("/")[-1]
        self.config = config or EngineConfig()
        self.stats = EngineStats()
        self._meter = Meter(self.stats)
        self.info = LoadedModel()
        # What a request that omits temperature/top_p/top_k/min_p gets; resolved at load.
        self.sampling_defaults = MLX_LM_DEFAULTS
        self._generation_config_fallback = generation_config_fallback
        self.tokenizer: Any = None
        self.cpu_fast_path: CpuFastPath | None = None  # set by the load on the CPU backend
        # Test hook: called on the owner thread right before a commit lands in the store.
        self.before_commit: Callable[[str], None] | None = None
        self._inbox = Inbox(self.config.admit_gap_s, self.config.admit_window_s)
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self._started = time.monotonic()
        disk = self.config.prompt_cache_disk
        self._store = PromptCacheStore(
            max_bytes=self.config.prompt_cache_bytes,
            disk=DiskTier(disk) if disk is not None else None,
        )
        self._commits = Commits(self._store, self.config, self.stats)
        self.speculation = SpeculationStats()
        self._draft: DraftModel | None = None  # the draft model's source, when configured
        # Owner-thread collaborators, made by the load (they need the model).
        self._rows: Rows
        self._followers: Followers
        self._model: Any = None
        self._gate: MemoryGate | None = None  # the memory budget's, made by the load
        self._next_turns: NextTurns | None = None  # made by the load, but for a split's rank 0
        self._round_started: float | None = None  # the owner thread's round (commands, a step)
        # Prompt tokens the rows still have to prefill, set at the end of each round on the owner
        # thread: the mesh's routing-time question reads it (a newcomer's prefill waits behind).
        self.prefill_backlog = 0

    # ---- lifecycle (caller side) -------------------------------------------------------------

    def start(self, timeout: float | None = None) -> None:
        """Start the owner thread and block until the model is loaded (raises EngineError)."""
        self._thread = threading.Thread(target=self._run, name="mlx-engine", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise EngineError(f"model {self.model_path} did not load in {timeout}s")
        if self._load_error is not None:
            raise EngineError(f"cannot load model {self.model_path}: {self._load_error}")

    def close(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._inbox.put("stop")
            self._thread.join(timeout=30)

    def discard_prompt_cache(self) -> None:
        """Drop every cached and pending prompt and the throughput window, in order after the
        commands before it. For the start-up warm-up (worker/serve/warm_up.py): its prompts
        must not show up as a user's cached tokens, nor its tokens as load."""
        self._inbox.put("discard")

    @property
    def draft_source(self) -> str:
        """Where speculation's drafts come from: the draft model's path, or prompt lookup."""
        return self.config.draft_model if self._draft is not None else "prompt lookup"

    @property
    def uptime_s(self) -> float:
        return time.monotonic() - self._started

    @property
    def prompt_cache(self) -> dict[str, Any]:
        """The memory tier's size, bound and hits (worker/prompt_cache/store.py ``summary``)."""
        return self._store.summary()

    @property
    def prompt_cache_disk(self) -> dict[str, Any] | None:
        """The disk tier's counters and bound (None: memory only). Read from any thread: a
        snapshot of plain numbers."""
        disk = self._store.disk
        return None if disk is None else disk.as_dict()

    @property
    def busy_s(self) -> float:
        """How long the owner thread has been in its current round (its commands and one step:
        a token, or a prefill chunk); 0 while it waits for work. The node's health check reads
        it (/health ``engine_busy_s``) to tell a stuck engine from a busy one."""
        started = self._round_started
        return 0.0 if started is None else time.monotonic() - started

    @property
    def cache_digest(self) -> CacheDigest:
        """What the prompt cache holds (block hashes, bounded), safe to read from any thread."""
        return self._store.digest

    def prefix_held(self, hashes: Sequence[int]) -> dict[str, Any]:
        """Tokens of a prompt (its block hashes) held in memory, on disk and by a pending
        commit, with the disk's restore rate (:meth:`Commits.prefix_held`); from any thread."""
        return self._commits.prefix_held(hashes)

    # ---- calls from the event loop -----------------------------------------------------------

    def submit(self, request: GenerationRequest) -> Job:
        """Queue a job; raises :class:`BudgetRefusal` when the memory budget cannot take it (a
        413 for one larger than the budget, a 429 while the budget is taken and the queue full)."""
        if self._gate is not None:
            budget = self._gate.budget
            need = budget.need(len(request.prompt), request.max_tokens)
            budget.check_submit(need, self.stats.queue_depth)
        job = Job(request, asyncio.get_running_loop())
        self._meter.submitted()
        self._inbox.put("submit", job)
        return job

    def cancel(self, job: Job) -> None:
        """Stop a job (client gone). Safe to call at any time, also after it finished."""
        if not job.done:
            self._inbox.put("cancel", job.id)

    def commit(self, job: Job, next_turn: list[int] | None = None) -> None:
        """Land a finished job's KV cache in the prompt cache; ``next_turn``: the tokens the
        next turn will show the conversation through this answer as (worker/chat/next_turn.py),
        the cache is brought to them after. Returns at once."""
        self.stats.log("commit_requested", job.id)
        self._inbox.put("commit", (job.id, next_turn))

    def tokens_per_second(self, window_s: float = 10.0) -> float:
        return self._meter.tokens_per_second(window_s)

    def prefill_tokens_per_second(self) -> float | None:
        return self._meter.prefill_tokens_per_second()

    # ---- owner thread ------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._load()
        except Exception as exc:  # reported to start(); the thread ends
            log.exception("model load failed")
            self._load_error = exc
            self._ready.set()
            return
        self._ready.set()
        handlers = {
            "submit": self._on_submit,
            "cancel": self._on_cancel,
            "commit": self._on_commit,
            "discard": self._on_discard,
        }
        while True:
            self._round_started = None
            commands = self._inbox.drain(wait_s=self._idle_wait(), idle=not self._rows)
            self._round_started = time.monotonic()
            if any(kind == "stop" for kind, _ in commands):
                break
            for kind, arg in commands:
                try:
                    handlers[kind](arg)
                except Exception as exc:
                    # One bad job must not take the owner thread (and the server) down.
                    log.exception("engine command %s failed", kind)
                    if kind == "submit":
                        self._reject(arg, f"cannot start generation: {exc}")
            self._between_steps()
            if self._rows:
                try:
                    self._step()
                    self._followers.release()
                except Exception as exc:
                    log.exception("generation step failed")
                    self._fail_all(f"generation failed: {exc}")
            elif not commands:
                self._tell_idle()
            self.prefill_backlog = self._rows.backlog()
        self._shutdown()

    def _between_steps(self) -> None:
        """The work of a round besides its step: parked jobs whose commit landed, expired
        commits, a chunk of an answer's next turn, the jobs the memory budget has room for."""
        for job in self._commits.due():
            self._start(job)
        self._commits.expire()
        if self._next_turns:
            self._next_turns.step(bool(self._rows), self._commits.waited_for())
        if self._gate is not None:
            self._open_gate(self._gate)

    def _tell_idle(self) -> None:
        """A model that wants to know the engine is idle (a split's rank 0 lets its other
        ranks doze off the ring: worker/split/leader.py) hears it here, on this thread."""
        idle = getattr(self._model, "engine_idle", None)
        if idle is None:
            return
        try:
            idle()
        except Exception:
            log.exception("the model's idle hook failed")

    def _load(self) -> None:
        import mlx.core as mx
        from mlx_lm.generate import make_stop_sequences

        model, tokenizer, config, self.cpu_fast_path = load_model(
            self.model_path, self._loader, self.config
        )
        self.tokenizer = tokenizer
        self.info = LoadedModel.from_config(config, model)
        self.sampling_defaults = resolve_sampling_defaults(
            self.model_path, self._generation_config_fallback
        )
        self.context_length = self.info.context_length
        stream = mx.default_stream(mx.default_device())
        self.batchable = can_batch(model, self.config)
        if self.config.draft_model and self.batchable and self.config.speculation.on:
            path = self.config.draft_model
            draft, draft_tokenizer, _, _ = load_model(path, None, self.config)
            self._draft = make_draft(path, draft, draft_tokenizer, tokenizer)
        elif self.config.draft_model:
            log.warning(
                "draft model %s not loaded: this model does not speculate", self.config.draft_model
            )

        def fresh_generator() -> Any:
            return make_generator(
                model,
                tokenizer,
                self.config,
                batchable=self.batchable,
                stream=stream,
                speculation=self.speculation,
                source=self._draft,
            )

        self._model = model
        self._rows = Rows(
            fresh_generator,
            tokenizer=tokenizer,
            eos_stops=make_stop_sequences(tokenizer),
            batchable=self.batchable,
            config=self.config,
            store=self._store,
            meter=self._meter,
            stats=self.stats,
            on_leave=self._left,
        )
        self._followers = Followers(self._rows, self._store, self.config, self.stats, self._reject)
        # A loader's model (a split's rank 0) is not probed: a forward pass would run the ring.
        if self._loader is None:
            pending = self._commits
            self._gate = memory_gate(self.config, model, self._store, lambda: pending.pending_bytes)
            if self.config.next_turn_max_tail > 0:
                self._next_turns = NextTurns(
                    model, self._store, pending, step_size=self.config.prefill_step_size,
                    max_tail=self.config.next_turn_max_tail,
                )  # fmt: skip

    def _left(self, job: Job) -> None:
        if self._gate is not None:
            self._gate.leave(job)

    @property
    def memory_budget(self) -> dict[str, int] | None:
        """The budget's limit and use (None: no budget). Plain numbers, read from any thread."""
        return None if self._gate is None else self._gate.budget.as_dict()

    def _idle_wait(self) -> float:
        """How long to block for commands: not at all while decoding, else until the next
        parked job's deadline (or a short tick for pending-commit expiry)."""
        if self._rows or self._next_turns:
            return 0.0
        nearest = self._commits.next_deadline()
        if nearest is not None:
            return max(0.0, min(0.25, nearest - time.monotonic()))
        return 0.25

    # ---- commands ----------------------------------------------------------------------------

    def _on_submit(self, job: Job) -> None:
        if not self._commits.park(job):
            self._start(job)

    def _start(self, job: Job) -> None:
        """Start a job once its projected KV fits the memory budget (else it waits for room)."""
        if self._gate is not None and not self._gate.enter(job):
            self.stats.log("waits_for_memory", job.id)
            return
        self._admit(job)

    def _open_gate(self, gate: MemoryGate) -> None:
        """Start the jobs the memory budget has room for now; fail one that nothing running
        could ever make room for. (Each loop: /health reads the use it keeps.)"""
        gate.refresh()
        for job in gate.due():
            self._admit(job)
        if not self._rows and not self._followers and (stuck := gate.stuck()) is not None:
            self._reject(stuck, "not enough memory for this request on this worker")

    def _admit(self, job: Job) -> None:
        """Start a job; one that cannot start fails alone."""
        try:
            self._followers.admit(job)
        except Exception as exc:
            log.exception("cannot start job %s", job.id)
            self._reject(job, f"cannot start generation: {exc}")

    def _on_commit(self, commit: tuple[str, list[int] | None]) -> None:
        job_id, next_turn = commit
        pending = self._commits.pending.get(job_id)
        self._commits.land(job_id, self.before_commit)
        if pending is not None and next_turn and self._next_turns is not None:
            self._next_turns.plan(job_id, pending.tokens, next_turn)

    def _on_discard(self, _: None) -> None:
        self._commits.clear(forget_written=True)
        self._store.stats = PromptCacheStats()  # the warm-up's lookups are no user's hits
        self._meter.forget_rate()
        self.stats.log("discarded", "")

    def _on_cancel(self, job_id: str) -> None:
        if job_id in self._commits.pending:
            # Finished, but the client left before the commit: nobody waits on the response.
            self._on_commit((job_id, None))
            return
        parked = self._commits.cancel(job_id)
        waiting = self._followers.cancel(job_id)
        if self._gate is not None:
            waiting = waiting or self._gate.cancel(job_id)
            if waiting is not None:
                self._gate.leave(waiting)
        if parked or waiting:
            self._meter.left(first_token=False, cancelled=True)
            self.stats.log("cancelled", job_id)
        for active in self._rows:
            if active.job.id == job_id:
                self._stop(active)
                self._meter.cancelled()
                self.stats.log("cancelled", job_id)

    # ---- a step and its tokens ---------------------------------------------------------------

    def _step(self) -> None:
        for active, r in self._rows.step():
            self._on_token(active, r)

    def _on_token(self, active: Active, r: Any) -> None:
        job = active.job
        out = active.decode(r, self.tokenizer)
        if out.looped:
            assert active.loop is not None
            self._meter.loop_stopped(job.id, active.loop.period, active.completion_tokens)
        text, logprobs, finish, stopped = out.text, out.logprobs, out.finish, out.stopped
        if (text or logprobs) and not self._send(
            active, TokenChunk(text, logprobs, active.completion_tokens, active.cached_tokens)
        ):
            return
        if finish is None:
            return
        cache, tokens = self._rows.finish(active, r, stopped)
        self._followers.hand_over(active, cache, tokens)
        if cache is not None and tokens:
            self._commits.hold(job.id, list(tokens), cache)
        self.stats.log("finished", job.id)
        self._send(
            active,
            Finished(
                finish_reason=finish,
                prompt_tokens=len(job.request.prompt),
                completion_tokens=active.completion_tokens,
                cached_tokens=active.cached_tokens,
                stop_sequence=active.stop.matched if stopped else None,
            ),
        )
        self._meter.completed()

    def _send(self, active: Active, event: JobEvent) -> bool:
        if active.job._deliver(event):
            return True
        self._stop(active)
        return False

    # ---- ends --------------------------------------------------------------------------------

    def _stop(self, active: Active) -> None:
        """Stop a job before its end (its client left): its KV goes to the prompt cache
        (``Rows.stop``) and to the followers it covers."""
        cache, tokens = self._rows.stop(active)
        self._followers.hand_over(active, cache, tokens)

    def _reject(self, job: Job, message: str) -> None:
        """Fail one job that cannot run, wherever it waits or runs."""
        self._commits.unpark(job)
        self._followers.remove(job)
        if self._gate is not None:
            self._gate.leave(job)
        if not self._rows.remove(job):
            self._meter.left(first_token=False)
        job._deliver(Failed(message))

    def _fail_all(self, message: str) -> None:
        """A step failed: every running job fails, the generator starts afresh, and the
        followers (which ran nothing yet) start on their own (the next loop's steps)."""
        for active in self._rows.drop_all():
            active.job._deliver(Failed(message))
        self._rows.reset()
        self._followers.restart(self._followers.take_all())

    def _shutdown(self) -> None:
        for active in self._rows.drop_all():
            active.job._deliver(Failed("worker shutting down"))
        waiting = [p.job for p in self._commits.parked]
        waiting += [f.job for f in self._followers.take_all()]
        waiting += self._gate.take_all() if self._gate is not None else []
        for job in waiting:
            job._deliver(Failed("worker shutting down"))
            self._meter.left(first_token=False)
        self._commits.parked = []
        self._rows.close()
        self._commits.land_all()
        if (written := self._store.flush_to_disk()) > 0:
            log.info("wrote %d prompt caches to disk", written)
        self._commits.clear()
