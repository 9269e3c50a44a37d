"""``--prompt-cache-gb`` travels from ``mesh up`` / ``mesh worker`` to the engine's config."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from mesh.cli import app
from mesh.node import NodeConfig
from mesh.workers import WorkerProcess
from worker.serve.main import build_parser


def test_the_node_passes_its_prompt_cache_size_to_its_workers(tmp_path: Path) -> None:
    options = NodeConfig(home=tmp_path, models=("m",), prompt_cache_gb=0.25).worker_options()
    command = WorkerProcess("m", options)._command()
    assert command[command.index("--prompt-cache-gb") + 1] == "0.25"
    parsed = build_parser().parse_args(
        ["--model", "m", *command[command.index("--prompt-cache-gb") :][:2]]
    )
    assert parsed.prompt_cache_gb == 0.25
    default = WorkerProcess("m", NodeConfig(home=tmp_path).worker_options())._command()
    assert default[default.index("--prompt-cache-gb") + 1] == "2"


def test_a_negative_size_is_refused_in_words(tmp_path: Path) -> None:
    for command in ("worker", "up"):
        args = [command, "--model", "m", "--home", str(tmp_path), "--prompt-cache-gb", "-1"]
        result = CliRunner().invoke(app, args)
        assert result.exit_code != 0
        assert "--prompt-cache-gb takes a size in GB" in " ".join(result.output.split())


def test_the_node_passes_its_disk_tier_and_memory_budget_to_its_workers(tmp_path: Path) -> None:
    config = NodeConfig(home=tmp_path, models=("m",), prompt_cache_disk_gb=4, memory_gb=0)
    command = WorkerProcess("m", config.worker_options())._command()
    parsed = build_parser().parse_args(["--model", "m", *command[command.index("--home") :]])
    assert parsed.prompt_cache_disk_gb == 4 and parsed.memory_gb == 0
    default = WorkerProcess("m", NodeConfig(home=tmp_path).worker_options())._command()
    assert "--prompt-cache-disk-gb" not in default and "--memory-gb" not in default


def test_a_negative_disk_tier_or_budget_is_refused_in_words(tmp_path: Path) -> None:
    for flag, words in (("--prompt-cache-disk-gb", "no disk tier"), ("--memory-gb", "no memory")):
        for command in ("worker", "up"):
            args = [command, "--model", "m", "--home", str(tmp_path), flag, "-1"]
            result = CliRunner().invoke(app, args)
            assert result.exit_code == 1 and words in " ".join(result.output.split())
