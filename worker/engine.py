"""The MLX engine: one owner thread runs the model; asyncio callers submit jobs and await tokens.

MLX streams are thread-local, so loading, prefill, decode and every KV-cache operation happen on
the owner thread. Callers talk to it through a command queue (submit, cancel, commit); tokens come
back through each job's asyncio queue via ``loop.call_soon_threadsafe``.

Concurrent jobs share the model through mlx-lm's ``BatchGenerator`` (continuous batching) when the
model's cache can be merged, else through ``SequentialGenerator`` (arrival order). Both advance
one step per call: a decoded token, or a prefill chunk of ``prefill_step_size`` prompt tokens.
Commands are drained between steps, so a cancel stops its job within one step, also a long
prompt's prefill within one chunk.

Jobs that arrive together with one prompt (the samples of ``model="mesh"``, Chat ``n > 1``) or a
long shared prefix prefill it once: a later one waits until the first one's cache holds the shared
tokens and starts from a copy of them (worker/shared_prefill.py decides when that pays). Each
sample stays its own job: cancelling one never stops its siblings; a source that leaves hands its
KV over to the followers it already covers and the others are placed again.

Prompt cache commit happens *after* the response: a finished job's KV cache is held as a pending
commit until the HTTP layer calls ``commit`` (after writing the terminal frame). A new job whose
prompt would reuse a pending commit waits for it (at most ``commit_wait_s``), so it never reads a
half-committed cache and the client of the first job never waits for the bookkeeping. A
cancelled job stores its cache at once (nobody is left to wait for): after its first token the
prompt and what it generated, during its prefill the prompt prefix of the chunks done, so a
client's retry of the same prompt resumes the prefill there.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from worker.cache_digest import CacheDigest
from worker.cpu import CpuFastPath, prepare_cpu_model
from worker.engine_types import (
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
from worker.loop_guard import LoopGuard
from worker.prompt_cache import PromptCacheStore, copy_cache
from worker.sampling import StopMatcher, make_request_processors, make_request_sampler
from worker.shared_prefill import Share, SharePolicy, Source, plan_share
from worker.tools.listing import Listing, listed
from worker.tools.prompt import generic_messages, renders_tools

log = logging.getLogger(__name__)

__all__ = ["Engine", "EngineConfig", "EngineError", "GenerationRequest", "Job"]


@dataclass
class _Active:
    job: Job
    uid: int
    detokenizer: Any
    stop: StopMatcher
    cached_tokens: int  # of the prompt, from the prompt cache or a sibling's prefill
    held: int = 0  # prompt tokens its KV cache holds now (grows chunk by chunk while prefilling)
    completion_tokens: int = 0
    first_token: bool = False
    loop: LoopGuard | None = None  # None: the loop guard is off


@dataclass
class _Parked:
    job: Job
    waits_for: set[str]
    deadline: float


@dataclass
class _Follower:
    """A job waiting for a running job's prefill to cover ``share.tokens`` of its prompt."""

    job: Job
    share: Share


@dataclass
class _Pending:
    tokens: list[int]
    cache: list[Any]
    created: float = field(default_factory=time.monotonic)


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
        loader: Callable[[str], tuple[Any, Any, dict[str, Any]]] | None = None,
    ) -> None:
        self.model_path = model_path
        # (model, tokenizer, config) from a path, on the owner thread; mlx_lm.load by default.
        # A split rank 0 passes its own (worker/split/rank.py: lazy, only its layers).
        self._loader = loader
        self.name = name or model_path.rstrip("/").split("/")[-1]
        self.config = config or EngineConfig()
        self.stats = EngineStats()
        self.info = LoadedModel()
        # What a request that omits temperature/top_p/top_k/min_p gets; resolved at load.
        self.sampling_defaults = MLX_LM_DEFAULTS
        self._generation_config_fallback = generation_config_fallback
        self.tokenizer: Any = None
        self.cpu_fast_path: CpuFastPath | None = None  # set by the load on the CPU backend
        # Test hook: called on the owner thread right before a commit lands in the store.
        self.before_commit: Callable[[str], None] | None = None
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self._lock = threading.Lock()
        self._rate: deque[tuple[float, int]] = deque()
        self._started = time.monotonic()
        # Owner-thread state.
        self._generator: Any = None
        self._active: dict[int, _Active] = {}
        self._parked: list[_Parked] = []
        self._followers: list[_Follower] = []
        self._share_policy = SharePolicy(min_tokens=self.config.share_prefill_min_tokens)
        self._pending: dict[str, _Pending] = {}
        self._store = PromptCacheStore(max_bytes=self.config.prompt_cache_bytes)

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
            self._inbox.put(("stop", None))
            self._thread.join(timeout=30)

    def discard_prompt_cache(self) -> None:
        """Drop every cached and pending prompt and the throughput window, in order after the
        commands before it. For the start-up warm-up (worker/warm_up.py): its prompts must not
        show up as a user's cached tokens, nor its tokens as load."""
        self._inbox.put(("discard", None))

    @property
    def uptime_s(self) -> float:
        return time.monotonic() - self._started

    @property
    def cache_digest(self) -> CacheDigest:
        """What the prompt cache holds (block hashes, bounded), safe to read from any thread."""
        return self._store.digest

    # ---- calls from the event loop -----------------------------------------------------------

    def submit(self, request: GenerationRequest) -> Job:
        job = Job(request, asyncio.get_running_loop())
        with self._lock:
            self.stats.queue_depth += 1
            self.stats.submitted += 1
        self._inbox.put(("submit", job))
        return job

    def cancel(self, job: Job) -> None:
        """Stop a job (client gone). Safe to call at any time, also after it finished."""
        if not job.done:
            self._inbox.put(("cancel", job.id))

    def commit(self, job: Job) -> None:
        """Land a finished job's KV cache in the prompt cache. Returns at once."""
        self.stats.log("commit_requested", job.id)
        self._inbox.put(("commit", job.id))

    def tokens_per_second(self, window_s: float = 10.0) -> float:
        now = time.monotonic()
        with self._lock:
            while self._rate and now - self._rate[0][0] > window_s:
                self._rate.popleft()
            if not self._rate:
                return 0.0
            tokens = sum(n for _, n in self._rate)
            span = max(now - self._rate[0][0], 1e-3)
        return tokens / span

    @functools.cached_property
    def tool_calling(self) -> str:
        """ "native" when the chat template shows the model tools and past calls, else
        "generic" (worker.tools.prompt writes them into the prompt as text)."""
        tok = self.tokenizer
        if not tok.has_chat_template:
            return "generic"

        def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
            return tok.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=False
            )

        return "native" if renders_tools(render) else "generic"

    def render_prompt(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        template_kwargs: dict[str, Any],
        listing: Listing = "full",
    ) -> tuple[list[int], bool]:
        """Prompt tokens through the chat template, and whether generation starts in a think
        block (the template opened ``<think>``), the tools shown as ``listing``
        (:mod:`worker.tools.listing`). Raises jinja errors for bad conversations."""
        tok = self.tokenizer
        if self.tool_calling == "generic" and (tools or _has_tool_turns(messages)):
            messages, tools = generic_messages(messages, tools, listing), None
        elif tools:
            tools = listed(tools, listing)
        if tok.has_chat_template:
            text = tok.apply_chat_template(
                messages,
                tools=tools or None,
                add_generation_prompt=True,
                tokenize=False,
                **template_kwargs,
            )
        else:
            text = "".join(f"{m['role']}: {m.get('content') or ''}\n" for m in messages)
            text += "assistant: "
        in_reasoning = False
        if tok.has_thinking:
            in_reasoning = text.rfind(tok.think_start) > text.rfind(tok.think_end)
        tokens = list(tok.encode(text, add_special_tokens=False))
        return tokens, in_reasoning

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
            commands = self._drain(wait_s=self._idle_wait())
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
            self._admit_parked()
            self._expire_pending()
            if self._active:
                try:
                    self._step()
                    self._release_followers()
                except Exception as exc:
                    log.exception("generation step failed")
                    self._fail_all(f"generation failed: {exc}")
            elif not commands:
                self._tell_idle()
        self._shutdown()

    def _tell_idle(self) -> None:
        """A model that wants to know the engine is idle (a split's rank 0 lets its other
        ranks doze off the ring: worker/split/rank.py) hears it here, on this thread."""
        idle = getattr(self._model, "engine_idle", None)
        if idle is None:
            return
        try:
            idle()
        except Exception:
            log.exception("the model's idle hook failed")

    def _load(self) -> None:
        import mlx.core as mx
        from mlx_lm import load
        from mlx_lm.generate import BatchGenerator, make_stop_sequences
        from mlx_lm.models.cache import make_prompt_cache

        from worker.sequential import SequentialGenerator

        if self._loader is not None:
            model, tokenizer, config = self._loader(self.model_path)
        else:
            model, tokenizer, config = load(self.model_path, return_config=True)
        if mx.default_device() == mx.cpu:
            if self.config.cpu_float32:
                model.set_dtype(mx.float32)
                mx.eval(model.parameters())
            self.cpu_fast_path = prepare_cpu_model(
                model, max_share=self.config.cpu_dequantize_share
            )
        self.tokenizer = tokenizer
        self.info = LoadedModel.from_config(config, model)
        self.sampling_defaults = resolve_sampling_defaults(
            self.model_path, self._generation_config_fallback
        )
        self.context_length = self.info.context_length
        stream = mx.default_stream(mx.default_device())
        self.batchable = self.config.batching and all(
            hasattr(c, "merge") for c in make_prompt_cache(model)
        )
        cfg = self.config
        if self.batchable:
            self._generator = BatchGenerator(
                model,
                completion_batch_size=cfg.completion_batch_size,
                prefill_batch_size=cfg.prefill_batch_size,
                prefill_step_size=cfg.prefill_step_size,
                stream=stream,
            )
        else:
            self._generator = SequentialGenerator(
                model,
                eos_token_ids=set(tokenizer.eos_token_ids),
                stream=stream,
                prefill_step_size=cfg.prefill_step_size,
            )
        self._eos_stops = make_stop_sequences(tokenizer)
        self._model = model

    def _idle_wait(self) -> float:
        """How long to block for commands: not at all while decoding, else until the next
        parked job's deadline (or a short tick for pending-commit expiry)."""
        if self._active:
            return 0.0
        if self._parked:
            nearest = min(p.deadline for p in self._parked)
            return max(0.0, min(0.25, nearest - time.monotonic()))
        return 0.25

    def _drain(self, *, wait_s: float) -> list[tuple[str, Any]]:
        commands = []
        try:
            if wait_s > 0:
                commands.append(self._inbox.get(timeout=wait_s))
            while True:
                commands.append(self._inbox.get_nowait())
        except queue.Empty:
            pass
        return commands

    def _on_submit(self, job: Job) -> None:
        prompt = job.request.prompt
        cached = self._store.best_prefix(prompt)
        waits = {
            job_id
            for job_id, pending in self._pending.items()
            if self._store.usable_prefix(pending.tokens, prompt, True) > cached
        }
        if waits:
            self.stats.commit_waits += 1
            self.stats.log("parked", job.id)
            deadline = time.monotonic() + self.config.commit_wait_s
            self._parked.append(_Parked(job, waits, deadline))
            return
        self._admit(job)

    def _admit_parked(self) -> None:
        if not self._parked:
            return
        now = time.monotonic()
        still = []
        for parked in self._parked:
            if not (parked.waits_for & self._pending.keys()):
                self._admit(parked.job)
            elif now >= parked.deadline:
                self.stats.commit_wait_timeouts += 1
                self._admit(parked.job)
            else:
                still.append(parked)
        self._parked = still

    def _admit(self, job: Job) -> None:
        """Start a job: from a running sibling's prefill when its prompt shares enough with one
        (worker/shared_prefill.py), else from what the prompt cache holds."""
        share = self._plan_share(job.request.prompt)
        if share is not None:
            follower = _Follower(job, share)
            if not share.ready:
                self.stats.log("follows", job.id)
                self._followers.append(follower)
                return
            self._fork_from(self._active[share.key], [follower])
            return
        self._start_alone(job)

    def _start_alone(self, job: Job) -> None:
        cache, cached = self._store.fetch(job.request.prompt, merged_by_reader=self.batchable)
        self._insert(job, cache, cached)

    def _plan_share(self, prompt: list[int]) -> Share | None:
        if not self.config.share_prefill or not self._active:
            return None
        sources = [Source(uid, a.job.request.prompt, a.held) for uid, a in self._active.items()]
        cached = self._store.best_prefix(prompt)
        return plan_share(prompt, sources, cached=cached, policy=self._share_policy)

    def _release_followers(self) -> None:
        """After a step: start the followers whose source now holds their shared tokens."""
        if not self._followers:
            return
        by_source: dict[int, list[_Follower]] = {}
        for follower in self._followers:
            by_source.setdefault(follower.share.key, []).append(follower)
        for uid, followers in by_source.items():
            source = self._active.get(uid)
            if source is None:  # gone without handing over (failed): start them on their own
                self._followers = [f for f in self._followers if f not in followers]
                self._restart_followers(followers)
            elif source.held >= min(f.share.tokens for f in followers):
                ready = [f for f in followers if source.held >= f.share.tokens]
                self._followers = [f for f in self._followers if f not in ready]
                self._fork_from(source, ready)

    def _fork_from(
        self,
        source: _Active,
        followers: list[_Follower],
        held: tuple[list[Any] | None, list[int] | None] | None = None,
    ) -> None:
        """Start ``followers`` (already out of the wait list) from a copy of ``source``'s KV,
        each trimmed to its shared tokens. ``held``: the source's (cache, tokens) when it has
        just left the generator; else they are read from it. A follower the copy cannot serve
        (a cache that cannot be trimmed back) starts alone."""
        from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

        if held is None:
            held = self._generator.extract_cache([source.uid]).get(source.uid)
        cache, tokens = held if held is not None else (None, None)
        started = []
        for follower in followers:
            if cache is None or not tokens:
                break
            n = follower.share.tokens
            excess = len(tokens) - n
            if excess < 0 or (excess and not can_trim_prompt_cache(cache)):
                continue
            if list(tokens[:n]) != follower.job.request.prompt[:n]:
                continue
            fork = copy_cache(cache, merged_by_reader=self.batchable)
            if excess:
                trim_prompt_cache(fork, excess)
            self._guarded(follower.job, self._insert, follower.job, fork, n, shared=True)
            started.append(follower)
        for follower in followers:
            if follower not in started:
                self._guarded(follower.job, self._start_alone, follower.job)

    def _restart_followers(self, followers: list[_Follower]) -> None:
        """Place followers (out of the wait list) whose source is gone as if just submitted:
        one of them may become the others' source."""
        for follower in followers:
            self._guarded(follower.job, self._admit, follower.job)

    def _guarded(self, job: Job, start: Callable[..., None], *args: Any, **kwargs: Any) -> None:
        """Start a waiting job; one that cannot start fails alone (as a bad submit does), not
        the step that released it."""
        try:
            start(*args, **kwargs)
        except Exception as exc:
            log.exception("cannot start job %s", job.id)
            self._reject(job, f"cannot start generation: {exc}")

    def _insert(self, job: Job, cache: list[Any] | None, cached: int, shared: bool = False) -> None:
        req = job.request
        params = req.sampling
        kwargs: dict[str, Any] = {}
        if self.batchable:
            kwargs["stop_sequences"] = [self._eos_stops]
        (uid,) = self._generator.insert(
            [req.prompt[cached:]],
            max_tokens=[req.max_tokens],
            caches=[cache],
            all_tokens=[req.prompt[:cached]],
            samplers=[make_request_sampler(params)],
            logits_processors=[make_request_processors(params) + list(req.logits_processors)],
            **kwargs,
        )
        # Not under a grammar: it ends the answer where the JSON is complete, and a cut would
        # be a "stop" whose JSON does not parse.
        span = 0 if req.logits_processors else self.config.loop_guard_tokens
        self._active[uid] = _Active(
            job,
            uid,
            self.tokenizer.detokenizer,
            StopMatcher(req.stop),
            cached,
            loop=LoopGuard(span) if span else None,
            held=cached,
        )
        self._count_prefill(len(req.prompt) - cached, cached if shared else 0)
        self.stats.log("shared_prefill" if shared else "admitted", job.id)
        if shared:
            self.stats.log("admitted", job.id)

    def _count_prefill(self, computed: int, shared: int) -> None:
        """A job runs ``computed`` prompt tokens; more than its last one is a prefill."""
        with self._lock:
            self.stats.prompt_tokens_computed += computed
            if computed > 1:
                self.stats.prefills += 1
            if shared:
                self.stats.shared_prefills += 1
                self.stats.shared_prefill_tokens += shared

    def _reject(self, job: Job, message: str) -> None:
        self._parked = [p for p in self._parked if p.job is not job]
        self._followers = [f for f in self._followers if f.job is not job]
        for uid, active in list(self._active.items()):
            if active.job is job:
                self._generator.remove([uid])
                self._drop(uid)
                break
        else:
            with self._lock:
                self.stats.queue_depth -= 1
        job._deliver(Failed(message))

    def _on_cancel(self, job_id: str) -> None:
        if job_id in self._pending:
            # Finished, but the client left before the commit: nobody waits on the response.
            self._on_commit(job_id)
            return
        parked = [p for p in self._parked if p.job.id == job_id]
        waiting = [f for f in self._followers if f.job.id == job_id]
        if parked or waiting:
            self._parked = [p for p in self._parked if p.job.id != job_id]
            self._followers = [f for f in self._followers if f.job.id != job_id]
            with self._lock:
                self.stats.queue_depth -= 1
                self.stats.cancelled += 1
            self.stats.log("cancelled", job_id)
        for active in list(self._active.values()):
            if active.job.id == job_id:
                self._stop(active)
                with self._lock:
                    self.stats.cancelled += 1
                self.stats.log("cancelled", job_id)

    def _on_commit(self, job_id: str) -> None:
        pending = self._pending.pop(job_id, None)
        if pending is None:
            return
        if self.before_commit is not None:
            self.before_commit(job_id)
        self._store.insert(pending.tokens, pending.cache)
        self.stats.commits += 1
        self.stats.log("committed", job_id)

    def _on_discard(self, _: None) -> None:
        self._store.clear()
        self._pending.clear()
        with self._lock:
            self._rate.clear()
        self.stats.log("discarded", "")

    def _expire_pending(self) -> None:
        if not self._pending:
            return
        now = time.monotonic()
        for job_id, pending in list(self._pending.items()):
            if now - pending.created > self.config.pending_commit_ttl_s:
                del self._pending[job_id]
                self.stats.log("commit_expired", job_id)

    def _step(self) -> None:
        progress, responses = self._generator.next()
        for p in progress:  # prefill chunks done: what a follower waits for
            if (active := self._active.get(p.uid)) is not None:
                active.held = max(active.held, active.cached_tokens + p.progress[0])
        decoded = 0
        for r in responses:
            active = self._active.get(r.uid)
            if active is None:
                continue
            decoded += 1
            self._on_token(active, r)
        if decoded:
            with self._lock:
                self._rate.append((time.monotonic(), decoded))
                self.stats.generated_tokens += decoded

    def _on_token(self, active: _Active, r: Any) -> None:
        job = active.job
        if not active.first_token:
            active.first_token = True
            active.held = len(job.request.prompt)
            with self._lock:
                self.stats.queue_depth -= 1
                self.stats.in_flight += 1
        active.completion_tokens += 1
        detok = active.detokenizer
        is_eos = r.finish_reason == "stop"
        if not is_eos:
            detok.add_token(r.token)
        if r.finish_reason is not None:
            detok.finalize()
        text, stopped = active.stop.feed(detok.last_segment)
        if not stopped and r.finish_reason is None and self._looping(active, r.token):
            text, stopped = text + active.stop.flush(), True  # ends as if the model had stopped
        finish = r.finish_reason
        if stopped:
            finish = "stop"
        elif finish is not None:
            text += active.stop.flush()
        logprobs = None
        if job.request.logprobs and not is_eos:
            logprob = r.logprobs[r.token].item()
            logprobs = [(self.tokenizer.decode([r.token]), logprob)]
        if (text or logprobs) and not self._send(
            active, TokenChunk(text, logprobs, active.completion_tokens, active.cached_tokens)
        ):
            return
        if finish is None:
            return
        if stopped and r.finish_reason is None:
            caches = self._generator.remove([r.uid], return_prompt_caches=True)
            cache, tokens = caches.get(r.uid, (None, None))
        else:
            cache, tokens = r.prompt_cache, r.all_tokens
        self._drop(r.uid)
        self._hand_over(active, cache, tokens)
        if cache is not None and tokens:
            self._pending[job.id] = _Pending(list(tokens), cache)
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
        with self._lock:
            self.stats.completed += 1

    def _looping(self, active: _Active, token: int) -> bool:
        if active.loop is None or not active.loop.feed(token):
            return False
        log.info(
            "job %s: stopped a loop of %d tokens after %d tokens",
            active.job.id, active.loop.period, active.completion_tokens,
        )  # fmt: skip
        with self._lock:
            self.stats.loops_stopped += 1
        return True

    def _send(self, active: _Active, event: JobEvent) -> bool:
        if active.job._deliver(event):
            return True
        self._stop(active)
        return False

    def _stop(self, active: _Active) -> None:
        """Stop a job before its end; what its KV cache holds goes to the store. After the
        first token that is the prompt and the tokens so far: a client that interrupts and
        sends the conversation again (agent harnesses do) and MoA's cancelled losers then skip
        that prefill. During the prefill it is the prompt prefix of the chunks already done
        (both generators keep the token list equal to the cache after every chunk): a client
        that timed out on a long cold prefill retries from there, not from zero."""
        caches = self._generator.remove([active.uid], return_prompt_caches=True)
        cache, tokens = caches.get(active.uid, (None, None))
        self._drop(active.uid)
        # Not yet prefilling (queued in the generator): the cache is the fetched copy of an
        # entry that is still in the store; nothing new to keep.
        if cache is not None and tokens and len(tokens) > active.cached_tokens:
            self._store.insert(list(tokens), cache)
            self.stats.log("cache_kept", active.job.id)
        self._hand_over(active, cache, tokens)

    def _hand_over(self, source: _Active, cache: Any, tokens: list[int] | None) -> None:
        """A source has left the generator (finished, stopped, cancelled; already dropped):
        its followers start from what its cache holds; those it does not cover yet are placed
        again (a cancelled one's partial prefill is in the store by then). A cancelled sample
        thus never takes its siblings with it."""
        followers = [f for f in self._followers if f.share.key == source.uid]
        if not followers:
            return
        self._followers = [f for f in self._followers if f.share.key != source.uid]
        covered = [f for f in followers if tokens and len(tokens) >= f.share.tokens]
        if covered:
            self._fork_from(source, covered, (cache, tokens))
        self._restart_followers([f for f in followers if f not in covered])

    def _drop(self, uid: int) -> None:
        active = self._active.pop(uid, None)
        if active is None:
            return
        with self._lock:
            if active.first_token:
                self.stats.in_flight -= 1
            else:
                self.stats.queue_depth -= 1

    def _fail_all(self, message: str) -> None:
        for uid, active in list(self._active.items()):
            active.job._deliver(Failed(message))
            self._drop(uid)
        self._reset_generator()
        # Followers ran nothing yet: they start on their own (the next loop's steps).
        followers, self._followers = self._followers, []
        self._restart_followers(followers)

    def _reset_generator(self) -> None:
        from mlx_lm.generate import BatchGenerator

        if self.batchable:
            self._generator.close()
            self._generator = BatchGenerator(
                self._model,
                completion_batch_size=self.config.completion_batch_size,
                prefill_batch_size=self.config.prefill_batch_size,
                prefill_step_size=self.config.prefill_step_size,
                stream=self._generator.stream,
            )

    def _shutdown(self) -> None:
        for uid, active in list(self._active.items()):
            active.job._deliver(Failed("worker shutting down"))
            self._drop(uid)
        waiting: list[_Parked | _Follower] = [*self._parked, *self._followers]
        for entry in waiting:
            entry.job._deliver(Failed("worker shutting down"))
            with self._lock:
                self.stats.queue_depth -= 1
        self._parked = []
        self._followers = []
        self._generator.close()
        self._store.clear()
        self._pending.clear()


def _has_tool_turns(messages: list[dict[str, Any]]) -> bool:
    return any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)
