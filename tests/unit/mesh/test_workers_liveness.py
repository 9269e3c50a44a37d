"""A stuck worker is withdrawn and killed; a withdrawn model stays listed and answers 503.

The supervisor half runs against a real stopped process (``sleep``, SIGSTOPped) with a client
whose health check never answers; the gateway half against the in-process app."""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.testing import ScriptedUpstream, asgi_request, text_script
from gateway.upstream import ModelInfo, StaticDirectory
from mesh.directory import offered_models
from mesh.worker_health import Health, HealthOptions
from mesh.workers import WorkerOptions, WorkerProcess, WorkerState

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="SIGSTOP")


class _SilentClient:
    """A worker client whose worker never answers its health check (a stopped process)."""

    model_name = "m"

    def __init__(self, answers: list[dict[str, Any] | None] | None = None) -> None:
        self.answers = list(answers or [])
        self.asked = 0

    async def health(self, timeout_s: float = 2.0) -> dict[str, Any] | None:
        self.asked += 1
        if self.answers:
            return self.answers.pop(0)
        await asyncio.sleep(timeout_s)  # accepted, never answered
        return None


def _process(tmp_path: Path, client: _SilentClient, misses: int = 2) -> WorkerProcess:
    health = HealthOptions(interval_s=0.05, misses=misses)
    process = WorkerProcess("m", WorkerOptions(home=tmp_path, health=health))
    process.client = client  # type: ignore[assignment]
    process.state = WorkerState.SERVING
    return process


async def test_a_stopped_worker_is_withdrawn_and_killed_after_the_stated_misses(
    tmp_path: Path,
) -> None:
    child = await asyncio.create_subprocess_exec("sleep", "60")
    child.send_signal(signal.SIGSTOP)  # SIGTERM would wait for a SIGCONT that never comes
    client = _SilentClient(answers=[{"status": "ok"}])
    process = _process(tmp_path, client, misses=3)
    listed: list[bool] = []

    async def on_listing(p: WorkerProcess, serving: bool) -> None:
        listed.append(serving)

    process.on_listing = on_listing
    async with asyncio.timeout(5):
        code = await process._wait_while_healthy(child)
    assert code == -signal.SIGKILL
    assert client.asked == 4  # one answer, then three misses in a row
    assert process.health is not None and process.health.state is Health.STUCK
    assert process.state is WorkerState.STUCK and listed == [False]


async def test_a_worker_that_answers_is_left_alone_until_it_exits(tmp_path: Path) -> None:
    child = await asyncio.create_subprocess_exec("sleep", "0.4")
    client = _SilentClient(answers=[{"status": "ok"}] * 100)
    process = _process(tmp_path, client)
    assert await process._wait_while_healthy(child) == 0
    assert process.state is WorkerState.SERVING and client.asked >= 3


async def test_checks_off_means_no_check(tmp_path: Path) -> None:
    child = await asyncio.create_subprocess_exec("sleep", "0.1")
    client = _SilentClient()
    process = _process(tmp_path, client)
    process.options = WorkerOptions(home=tmp_path, health=HealthOptions(interval_s=0))
    assert await process._wait_while_healthy(child) == 0
    assert client.asked == 0


def _directory() -> StaticDirectory:
    directory = StaticDirectory()
    directory.add(ModelInfo(id="m"), ScriptedUpstream(scripts=[text_script("ok")]))
    return directory


def test_a_withdrawn_model_stays_listed_without_a_route_and_is_not_offered() -> None:
    directory = _directory()
    directory.withdraw("m")
    directory.withdraw("never-served")  # a split model still forming: listed by name
    assert [m.id for m in directory.models()] == ["m", "never-served"]
    assert directory.routes("m") == []
    assert offered_models(directory) == []


async def test_a_request_for_a_withdrawn_model_is_503_with_retry_after() -> None:
    directory = _directory()
    directory.withdraw("m")
    app = create_app(directory, GatewayConfig())
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    for path, payload in (
        ("/v1/chat/completions", body),
        ("/v1/messages", {**body, "max_tokens": 5}),
        ("/v1/responses", {"model": "m", "input": "hi"}),
    ):
        result = await asgi_request(app, "POST", path, payload)
        assert result.status == 503, (path, result.body)
        assert result.headers["retry-after"] == "1"
    models = await asgi_request(app, "GET", "/v1/models")
    assert [m["id"] for m in models.json()["data"]] == ["m"]


def test_the_flags_reach_the_workers_options_and_bad_ones_are_refused_in_words(
    tmp_path: Path,
) -> None:
    from typer.testing import CliRunner

    from gateway.deadlines import StreamDeadlines
    from mesh.cli import app
    from mesh.cli.node import liveness_options
    from mesh.node import NodeConfig

    health, deadlines = liveness_options(30.0, 0.0, 1.0, 4, 90.0)
    assert health == HealthOptions(interval_s=1.0, misses=4, stall_s=90.0)
    assert deadlines == StreamDeadlines(first_token_s=30.0, idle_s=None)  # 0: no limit
    options = NodeConfig(home=tmp_path, health=health, deadlines=deadlines).worker_options()
    assert options.health == health and options.deadlines == deadlines
    runner = CliRunner()
    for flags, words in (
        (["--worker-health-misses", "0"], "at least 1"),
        (["--first-token-timeout", "-1"], "take seconds"),
    ):
        result = runner.invoke(app, ["up", "--home", str(tmp_path), "--no-worker", *flags])
        assert result.exit_code != 0 and words in result.output, result.output
