"""The one seam onto mlx-lm's internals: every private name of mlx-lm our code relies on, and the
install and uninstall of each process-wide patch we put into it.

Three subsystems reach past mlx-lm's public API, because what they do is not offered there:
- speculative decoding (worker/speculative/batch.py) steps the ``BatchGenerator`` through a
  subclass of its ``GenerationBatch``, reading and writing the batch's private per-row state,
  and trims the batch caches' write index;
- split serving (worker/split/cache.py) wraps ``generate._merge_caches`` so that rank 0 records
  every batch merge its followers must replay;
- the CPU fast path (worker/cpu/attention.py) points the model modules'
  ``scaled_dot_product_attention`` at a numpy one.

They hold only for the mlx-lm versions the project pins (``mlx-lm<0.33``). :data:`PRIVATE_NAMES`
lists them with the shape we expect; :func:`missing` checks them against the installed mlx-lm
(tests/unit/worker/test_mlx_lm_hooks.py runs it, so a version bump fails there, in one test
naming what moved), and each install checks its own subsystem's names first
(:func:`require`), so a bumped mlx-lm fails at start with one sentence, not mid-request.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

SPECULATION = "speculative decoding"
SPLIT = "split serving"
CPU_ATTENTION = "CPU attention"


class MlxLmSeamError(RuntimeError):
    """The installed mlx-lm lacks a private name one of our subsystems relies on."""


@dataclass(frozen=True, slots=True)
class PrivateName:
    """A name inside mlx-lm that we rely on: ``module``'s ``name``, or the attribute ``name``
    of ``module.owner`` (set in its source, for instance attributes); ``params``: a function's
    parameter names, in order, when we call or replace it."""

    module: str
    owner: str | None
    name: str
    used_by: str
    params: tuple[str, ...] | None = None

    @property
    def path(self) -> str:
        return ".".join(p for p in (self.module, self.owner, self.name) if p)

    def problem(self) -> str | None:
        """Why this name does not hold in the installed mlx-lm; None when it does."""
        try:
            module = importlib.import_module(self.module)
        except ImportError as exc:
            return f"{self.path} ({self.used_by}): cannot import {self.module}: {exc}"
        holder: Any = module
        if self.owner is not None:
            holder = getattr(module, self.owner, None)
            if holder is None:
                return f"{self.path} ({self.used_by}): {self.module} has no {self.owner}"
        if not _has(holder, self.name):
            return f"{self.path} ({self.used_by}): no such name in mlx-lm {_version()}"
        if self.params is not None:
            found = tuple(inspect.signature(getattr(holder, self.name)).parameters)
            if found != self.params:
                return f"{self.path} ({self.used_by}): parameters {found}, expected {self.params}"
        return None


def _has(holder: Any, name: str) -> bool:
    """A module's or class's attribute, or an instance attribute its class's source sets."""
    if hasattr(holder, name):
        return True
    if inspect.isclass(holder):
        try:
            source = inspect.getsource(holder)
        except (OSError, TypeError):
            return False
        return f"self.{name} =" in source or f"self.{name}:" in source
    return False


def _version() -> str:
    try:
        import mlx_lm

        return str(mlx_lm.__version__)
    except (ImportError, AttributeError):
        return "?"


_GEN = "mlx_lm.generate"
_CACHE = "mlx_lm.models.cache"
_BATCH = "GenerationBatch"

PRIVATE_NAMES: tuple[PrivateName, ...] = (
    # speculative decoding: the batch we put into the generator, and what it reads of it
    PrivateName(_GEN, "BatchGenerator", "_generation_batch", SPECULATION),
    PrivateName(_GEN, "BatchGenerator", "_counters", SPECULATION),
    PrivateName(_GEN, "BatchCounters", "prompt_tokens", SPECULATION),
    PrivateName(_GEN, _BATCH, "empty", SPECULATION),
    PrivateName(_GEN, _BATCH, "Response", SPECULATION),
    PrivateName(_GEN, _BATCH, "_next_tokens", SPECULATION),
    PrivateName(_GEN, _BATCH, "_next_logprobs", SPECULATION),
    PrivateName(_GEN, _BATCH, "_current_tokens", SPECULATION),
    PrivateName(_GEN, _BATCH, "_num_tokens", SPECULATION),
    PrivateName(_GEN, _BATCH, "_matchers", SPECULATION),
    PrivateName(_GEN, _BATCH, "_token_context", SPECULATION),
    PrivateName(_CACHE, "BatchKVCache", "_idx", SPECULATION),
    PrivateName(_CACHE, "BatchRotatingKVCache", "_idx", SPECULATION),
    PrivateName(_CACHE, "BatchRotatingKVCache", "_lengths", SPECULATION),
    PrivateName(_CACHE, "BatchRotatingKVCache", "_temporal_order", SPECULATION),
    # split serving: rank 0 records the merges of its batch caches
    PrivateName(_GEN, None, "_merge_caches", SPLIT, params=("caches",)),
    # the CPU fast path: the attention the model modules import from base
    PrivateName(
        "mlx_lm.models.base",
        None,
        "scaled_dot_product_attention",
        CPU_ATTENTION,
        params=("queries", "keys", "values", "cache", "scale", "mask", "sinks"),
    ),
)


def missing(names: Iterable[PrivateName] = PRIVATE_NAMES) -> list[str]:
    """What does not hold in the installed mlx-lm, one line a name (empty: all hold)."""
    return [problem for name in names if (problem := name.problem()) is not None]


def require(used_by: str) -> None:
    """Raise :class:`MlxLmSeamError` when a name ``used_by`` relies on does not hold."""
    problems = missing(n for n in PRIVATE_NAMES if n.used_by == used_by)
    if problems:
        raise MlxLmSeamError(
            f"{used_by} does not work with mlx-lm {_version()} (the project pins mlx-lm<0.33): "
            + "; ".join(problems)
        )


# ---- speculative decoding ---------------------------------------------------------------------


def generation_batch_class() -> type:
    """mlx-lm's ``GenerationBatch``, the class speculation's batch extends."""
    found: type = getattr(importlib.import_module(_GEN), _BATCH)
    return found


def install_generation_batch(generator: Any, batch: Any) -> None:
    """Make ``batch`` the generation batch of a fresh ``BatchGenerator``."""
    require(SPECULATION)
    generator._generation_batch = batch


def prompt_tokens_counter(generator: Any) -> Callable[[], int]:
    """The generator's count of prompt tokens prefilled so far, read on each call."""
    counters = generator._counters
    return lambda: int(counters.prompt_tokens)


def write_index(cache: Any) -> int:
    """A batch cache's write index: its columns, its rows' left padding included."""
    return int(getattr(cache, "_idx", 0))


def set_window_lengths(cache: Any, lengths: Any) -> None:
    """A sliding window's row lengths, before its ``finalize`` rolls the rest into padding."""
    cache._lengths = lengths


def put_window_in_order(cache: Any) -> None:
    """A rotated sliding window back in temporal order."""
    cache._temporal_order()


# ---- split serving: batch merges ----------------------------------------------------------------

_merges: list[Callable[[list[list[Any]]], list[Any]]] = []  # mlx-lm's own, once wrapped


def wrap_merge_caches(wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace ``generate._merge_caches`` by ``wrap(original)``, once per process."""
    if _merges:
        return
    require(SPLIT)
    generate = importlib.import_module(_GEN)  # the package's name ``generate`` is a function
    _merges.append(generate._merge_caches)
    setattr(generate, "_merge_caches", wrap(_merges[0]))  # noqa: B010 (a module mypy cannot see)


def original_merge_caches() -> Callable[[list[list[Any]]], list[Any]]:
    """mlx-lm's own ``_merge_caches``, whether wrapped or not."""
    if _merges:
        return _merges[0]
    found: Callable[[list[list[Any]]], list[Any]] = importlib.import_module(_GEN)._merge_caches
    return found


# ---- the CPU fast path: attention ---------------------------------------------------------------

_ATTENTION = "scaled_dot_product_attention"
_attention_patched: dict[str, Any] = {}  # module name → the function it had


def mlx_attention() -> Any:
    """mlx-lm's own ``scaled_dot_product_attention``."""
    return importlib.import_module("mlx_lm.models.base").scaled_dot_product_attention


def patch_attention(module_names: Iterable[str], replacement: Any) -> list[str]:
    """Point each of ``module_names`` that uses mlx-lm's own attention at ``replacement``
    (a module with its own keeps it); returns the modules that now use it."""
    require(CPU_ATTENTION)
    original = mlx_attention()
    done = []
    for name in sorted(module_names):
        module = sys.modules.get(name)
        current = getattr(module, _ATTENTION, None)
        if current is replacement:
            done.append(name)
        elif current is original:
            _attention_patched[name] = current
            setattr(module, _ATTENTION, replacement)
            done.append(name)
    return done


def unpatch_attention() -> None:
    """Give every patched module back the attention it had."""
    for name, function in _attention_patched.items():
        module = sys.modules.get(name)
        if module is not None:
            setattr(module, _ATTENTION, function)
    _attention_patched.clear()


# ---- import: mlx-lm's open-files limit --------------------------------------------------------

_MLX_LM_WANTS_HARD_NOFILE = 4096  # mlx_lm/utils.py: setrlimit(RLIMIT_NOFILE, (2048, 4096))


def import_within_open_files_limit() -> None:
    """Import ``mlx_lm.utils`` with its import-time ``setrlimit(RLIMIT_NOFILE, (2048, 4096))``
    held to the hard limit this process has. Unchanged, that call raises ``ValueError`` where
    the hard limit is below 4096 (``ulimit -n 1024``, a container without CAP_SYS_RESOURCE),
    and every import of mlx-lm – the worker's, a pull's – died with a traceback. Only then is
    mlx-lm imported here, so an ordinary start pays nothing."""
    import resource

    if "mlx_lm.utils" in sys.modules:
        return
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard >= _MLX_LM_WANTS_HARD_NOFILE:
        return
    real = resource.setrlimit

    def held(which: int, limits: tuple[int, int]) -> None:
        if which == resource.RLIMIT_NOFILE:
            current_soft, current_hard = resource.getrlimit(which)
            limits = (min(max(limits[0], current_soft), current_hard), current_hard)
        real(which, limits)

    resource.setrlimit = held
    try:
        importlib.import_module("mlx_lm.utils")
    finally:
        resource.setrlimit = real
