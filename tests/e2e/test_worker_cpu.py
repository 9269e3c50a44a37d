"""The CPU fast path in real processes: the OpenBLAS preload takes effect in a child, a worker
restarts itself with it, and a quantized model is served as float32 and says so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from worker.cpu import fast_path as cpu
from worker.serve.net import SECRET_ENV
from worker.testing import make_tiny_model, quantize_tiny_model, run_worker_in_thread

LIBRARY = cpu.find_openblas()
needs_openblas = pytest.mark.skipif(
    LIBRARY.path is None or sys.platform != "linux" or not cpu.mlx_uses_cpu(),
    reason=f"the OpenBLAS fast path does not apply here: {LIBRARY.reason or 'not Linux CPU'}",
)

PROBE = (
    "import json, os; from worker.cpu import fast_path as cpu; p = cpu.probe_blas(); "
    "print(json.dumps({'fast': p.fast, 'blas': p.blas, 'gflops': p.gflops, "
    "'library': p.library, 'reason': p.reason, 'line': p.line(), "
    "'preload': os.environ.get('LD_PRELOAD'), 'pid': os.getpid()}))"
)


def _clean_env() -> dict[str, str]:
    """This process's environment minus any preload (make test may run pytest with one);
    OPENBLAS_CORETYPE and friends pass through untouched."""
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", cpu.REEXEC_MARKER)}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(cpu.__file__).parents[1]), *sys.path])
    return env


def _run(code: str, env: dict[str, str]) -> list[dict]:
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


@needs_openblas
def test_child_started_with_the_preload_env_runs_openblas() -> None:
    (probe,) = _run(PROBE, cpu.preload_env(_clean_env()))
    assert probe["fast"] is True and probe["blas"] == "openblas", probe
    assert os.path.realpath(probe["library"]) == os.path.realpath(LIBRARY.path)
    assert probe["reason"] is None
    assert probe["line"].startswith("cpu blas: openblas")


@needs_openblas
def test_child_without_it_says_why_not() -> None:
    (probe,) = _run(PROBE, _clean_env())
    assert probe["fast"] is False and probe["blas"] == "reference"
    assert "is not preloaded" in probe["reason"], probe
    assert "fast path off" in probe["line"]


@needs_openblas
def test_worker_process_restarts_itself_once_with_the_preload() -> None:
    code = (
        "import json, os; print(json.dumps({'before': os.getpid()}), flush=True); "
        "from worker.cpu import fast_path as cpu; cpu.reexec_with_fast_blas(); " + PROBE
    )
    before_1, before_2, probe = _run(code, _clean_env())
    # The code ran twice in the same process (exec, not a child); the second time it stopped.
    assert before_1 == before_2 == {"before": probe["pid"]}
    assert probe["fast"] is True, probe
    assert str(LIBRARY.path) in probe["preload"]


def _worker_lines(
    model_dir: Path, *extra: str, secret: str | None = None
) -> tuple[list[str], dict]:
    """Start ``python -m worker``, read its announcement and CPU lines and its /health."""
    command = [sys.executable, "-m", "worker", "--model", str(model_dir), "--port", "0", *extra]
    env = _clean_env() | ({SECRET_ENV: secret} if secret else {})
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    headers = {"authorization": f"Bearer {secret}"} if secret else {}
    try:
        assert process.stdout is not None
        lines = [process.stdout.readline() for _ in range(2)]
        assert lines[0].startswith("worker listening on "), lines
        url = f"{lines[0].split()[3]}/health"
        if secret:
            # The restart kept the node's secret: without it the port is closed.
            assert httpx.get(url, timeout=30).status_code == 401
        health = httpx.get(url, headers=headers, timeout=30).json()
    finally:
        process.terminate()
        process.wait(timeout=30)
    return lines, health


@needs_openblas
def test_python_m_worker_runs_on_openblas_unless_told_not_to(tiny_model_dir: Path) -> None:
    lines, health = _worker_lines(tiny_model_dir)
    assert lines[1].startswith("cpu blas: openblas"), lines
    assert health["cpu_fast_path"]["blas"] == "openblas"
    lines, health = _worker_lines(tiny_model_dir, secret="node-secret")
    assert lines[1].startswith("cpu blas: openblas") and health["status"] == "ok", lines
    lines, health = _worker_lines(tiny_model_dir, "--no-fast-blas")
    assert lines[1].startswith("cpu blas: reference") and "is not preloaded" in lines[1], lines
    assert health["cpu_fast_path"]["blas"] == "reference"


def test_no_restart_when_turned_off_or_already_tried() -> None:
    code = "from worker.cpu import fast_path as cpu; cpu.reexec_with_fast_blas(); " + PROBE
    for extra in ({cpu.BLAS_ENV: "off"}, {cpu.REEXEC_MARKER: "1"}):
        (probe,) = _run(code, {**_clean_env(), **extra})
        assert probe["preload"] is None and probe["fast"] is False


def test_quantized_model_is_served_as_float32_and_says_so(tmp_path: Path) -> None:
    if not cpu.mlx_uses_cpu():
        pytest.skip("MLX runs on an accelerator here: the CPU fast path does not apply")
    model_dir = quantize_tiny_model(make_tiny_model(tmp_path / "q4"))
    with run_worker_in_thread(model_dir, name="tiny-q4") as (url, engine):
        (entry,) = httpx.get(f"{url}/models", timeout=30).json()["data"]
        health = httpx.get(f"{url.removesuffix('/v1')}/health", timeout=30).json()
        reply = httpx.post(
            f"{url}/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            timeout=60,
        ).json()
    assert entry["quantization"] == "q4"  # the stored model is what it was
    fast = entry["cpu_fast_path"]
    assert fast["dequantized"] is True and health["cpu_fast_path"] == fast
    assert engine.cpu_fast_path is not None and engine.cpu_fast_path.dequant.layers == 16
    if sys.platform == "linux":
        assert fast["blas"] in ("openblas", "reference") and fast["gflops"] > 0
    assert reply["usage"]["completion_tokens"] == 4
