"""The seam onto mlx-lm's internals: every private name we rely on is in the installed mlx-lm
with the shape we expect. A version bump that moves one fails here, naming it."""

from __future__ import annotations

import importlib
import resource
import subprocess
import sys

import pytest

from worker import mlx_lm_hooks
from worker.mlx_lm_hooks import (
    CPU_ATTENTION,
    PRIVATE_NAMES,
    SPECULATION,
    SPLIT,
    MlxLmSeamError,
    PrivateName,
    missing,
    require,
)


def test_every_private_mlx_lm_name_we_rely_on_is_there() -> None:
    assert missing() == [], "mlx-lm moved names our code relies on (worker/mlx_lm_hooks.py)"


def test_each_subsystem_declares_its_names() -> None:
    assert {name.used_by for name in PRIVATE_NAMES} == {SPECULATION, SPLIT, CPU_ATTENTION}


def test_a_renamed_private_function_is_reported_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    generate = importlib.import_module("mlx_lm.generate")
    monkeypatch.setattr(generate, "_merge_caches_renamed", generate._merge_caches, raising=False)
    monkeypatch.delattr(generate, "_merge_caches")
    problems = missing()
    assert len(problems) == 1
    assert problems[0].startswith("mlx_lm.generate._merge_caches (split serving)")
    with pytest.raises(MlxLmSeamError, match="split serving does not work with mlx-lm"):
        require(SPLIT)
    require(SPECULATION)  # the other subsystems are unaffected


def test_a_renamed_instance_attribute_is_reported() -> None:
    """Instance attributes are found in the class's source: a name it never sets is missing."""
    name = PrivateName("mlx_lm.generate", "GenerationBatch", "_next_tokenz", SPECULATION)
    assert missing([name]) == [
        f"mlx_lm.generate.GenerationBatch._next_tokenz (speculative decoding): no such name in"
        f" mlx-lm {mlx_lm_hooks._version()}"
    ]


def test_a_changed_signature_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    base = importlib.import_module("mlx_lm.models.base")

    def attention(queries, keys, values, cache, scale, mask):  # type: ignore[no-untyped-def]
        raise AssertionError("never called")

    monkeypatch.setattr(base, "scaled_dot_product_attention", attention)
    (problem,) = missing()
    assert "scaled_dot_product_attention (CPU attention): parameters" in problem
    with pytest.raises(MlxLmSeamError, match="CPU attention"):
        require(CPU_ATTENTION)


def _under_low_open_files_limit(code: str) -> subprocess.CompletedProcess[str]:
    def low_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))

    return subprocess.run(
        [sys.executable, "-c", code],
        preexec_fn=low_limit,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_mlx_lm_imports_under_a_low_open_files_limit() -> None:
    """mlx-lm's import asks for a hard limit of 4096 and raised under ``ulimit -n 256``: every
    worker and ``mesh up`` died with a traceback. Importing ``worker`` first holds it."""
    done = _under_low_open_files_limit(
        "import worker; from mlx_lm import load; import resource;"
        " print(resource.getrlimit(resource.RLIMIT_NOFILE))"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "(256, 256)"
    # The case it fixes: mlx-lm alone still fails there.
    alone = _under_low_open_files_limit("import mlx_lm.utils")
    assert alone.returncode != 0 and "not allowed to raise maximum limit" in alone.stderr
