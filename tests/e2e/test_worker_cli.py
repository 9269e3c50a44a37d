"""`python -m worker` and `mesh worker` as a person or the node supervisor runs them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from worker.serve.main import locate_model


def test_python_m_worker_serves_and_announces_its_url(tiny_model_dir: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "worker", "--model", str(tiny_model_dir), "--port", "0",
               "--name", "tiny"]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    try:
        assert process.stdout is not None
        line = ""
        for raw in process.stdout:
            line = raw.decode()
            if line.startswith("worker listening on "):
                break
        assert line.startswith("worker listening on http://127.0.0.1:"), line
        url = line.split()[3]
        assert line.rstrip().endswith("(model tiny)")
        health = httpx.get(f"{url}/health", timeout=30).json()
        assert health["status"] == "ok" and health["model"] == "tiny"
        assert health["warm_up_s"] is not None  # warmed up before it said it was listening
        reply = httpx.post(
            f"{url}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
            timeout=60,
        ).json()
        assert reply["usage"]["completion_tokens"] == 3
        # The warm-up's prompt shares the template's opening with this one: none of it cached.
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    finally:
        process.terminate()
        assert process.wait(timeout=30) is not None


def test_ctrl_c_stops_the_worker_quietly(tiny_model_dir: Path) -> None:
    """No uvicorn lifespan traceback, no C++ abort (exit 134): exit status 0."""
    command = [sys.executable, "-m", "worker", "--model", str(tiny_model_dir), "--port", "0"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        assert process.stdout is not None
        announced = process.stdout.readline().decode()
        assert announced.startswith("worker listening on "), announced
        httpx.get(f"{announced.split()[3]}/health", timeout=30).raise_for_status()
        process.send_signal(signal.SIGINT)
        rest = process.stdout.read().decode()
        assert process.wait(timeout=30) == 0, rest
        assert "Traceback" not in rest and "terminate called" not in rest, rest
    finally:
        process.kill()
        process.wait(timeout=30)


def test_missing_model_directory_is_one_clear_error(tmp_path: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    missing = tmp_path / "nope"
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "from mesh.cli import main; main()",
            "worker",
            "--model",
            str(missing),
            "--port",
            "0",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 1
    assert "error:" in result.stderr and "nope" in result.stderr
    assert "Traceback" not in result.stderr


def test_locate_model_prefers_directories(tiny_model_dir: Path) -> None:
    assert locate_model(str(tiny_model_dir), None) == str(tiny_model_dir.resolve())


def test_locate_model_uses_the_store(tmp_path: Path, tiny_model_dir: Path) -> None:
    import shutil

    from worker import store

    home = tmp_path / "home"
    shutil.copytree(tiny_model_dir, store.models_dir(home) / "tiny")
    assert locate_model("tiny", home) == str(store.models_dir(home) / "tiny")
    with pytest.raises(LookupError, match="mesh models pull"):
        locate_model(store.DEFAULT_MODEL, home)
    assert locate_model("mlx-community/some-model", home) == "mlx-community/some-model"


@pytest.mark.parametrize("warm_up", [True, False])
def test_the_worker_warms_up_before_it_announces(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, warm_up: bool
) -> None:
    """The announcement is what the node waits for: by then the warm-up has run."""
    import uvicorn

    from worker.serve import app
    from worker.serve import main as serve_main

    seen: list[float | None] = []
    monkeypatch.setattr(app, "_announce", lambda engine, url: seen.append(engine.stats.warm_up_s))
    monkeypatch.setattr(uvicorn.Server, "run", lambda server, sockets: None)
    serve_main.run(str(tiny_model_dir), port=0, fast_blas=False, warm_up=warm_up)
    assert len(seen) == 1 and (seen[0] is not None) == warm_up
