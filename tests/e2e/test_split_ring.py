"""A model split over 2 and 3 rank processes (MLX ring backend on loopback) answers exactly as
the unsplit model does, for llama (sliding and global layers) and gemma3, each rank reading only
its slice's weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mesh.loopback_ports import free_ports
from mesh.split.testing import bridged_hostfiles, spawn_ranks
from worker.cpu.fast_path import REEXEC_MARKER
from worker.serve.split_rank import GROUP_BROKEN
from worker.testing import make_tiny_gemma3_model, make_tiny_model, run_worker_in_thread

mx = pytest.importorskip("mlx.core")
if not mx.distributed.is_available("ring"):
    pytest.skip("this MLX build has no ring backend (mx.distributed)", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
# Long enough to cross the 3-token sliding window and to take several prefill chunks.
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [40, 41, 42]]
MAX_TOKENS = 6


def rank_env() -> dict[str, str]:
    """The rank processes run with this process's BLAS (no OpenBLAS restart of their own), so
    that the in-process reference does the very same arithmetic."""
    return {**os.environ, "PYTHONPATH": str(ROOT), REEXEC_MARKER: "1"}


def run_ranks(
    model: Path, split: list[int], tmp: Path, hostfiles: dict[int, list] | None = None
) -> list[dict]:
    """Run one ``worker.serve.split_rank`` process per rank; every JSON line, rank 0's first.
    ``hostfiles``: each rank's own hostfile (by default one shared, all on loopback)."""
    (tmp / "prompts.json").write_text(json.dumps(PROMPTS))
    common = [
        sys.executable,
        "-m",
        "worker.serve.split_rank",
        "--model",
        str(model),
        "--prompts",
        str(tmp / "prompts.json"),
        "--max-tokens",
        str(MAX_TOKENS),
        "--prefill-step",
        "4",
    ]
    procs = spawn_ranks(common, split, tmp, rank_env(), hostfiles)
    lines = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=120)
            assert proc.returncode == 0
            lines += [
                json.loads(line) for line in out.decode().splitlines() if line.startswith("{")
            ]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return lines


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("split-models")
    return {
        "llama": make_tiny_model(root / "llama", num_layers=6, sliding_window=3),
        "gemma3": make_tiny_gemma3_model(root / "gemma3", num_layers=6, sliding_window=3),
    }


def unsplit(model: Path) -> tuple[list[list[int]], int]:
    """The reference, in this process: the same loop, the whole model, no group."""
    from worker.serve.split_rank import eos_ids, generate, load_slice
    from worker.split.leader import LeaderModel
    from worker.split.lockstep import Lockstep

    whole, _, _, weights = load_slice(model, None, None)
    leader = LeaderModel(whole, Lockstep(None))
    outputs = [
        generate(leader, p, max_tokens=MAX_TOKENS, eos=eos_ids(model), prefill_step=4)
        for p in PROMPTS
    ]
    return outputs, weights


# Three uneven ranks of gemma3 here, ~10 s on 2 cores (the rank processes' start-up, importing
# mlx-lm, is most of it); llama over two ranks is tests/e2e/test_split_mesh.py, through the
# gateway. Add ("llama", [1, 4, 1]) etc. locally when changing worker/split/pipeline.py.
@pytest.mark.parametrize(("arch", "split"), [("gemma3", [2, 1, 3])])
def test_split_output_is_token_identical_to_unsplit(
    models: dict[str, Path], arch: str, split: list[int], tmp_path: Path
) -> None:
    expected, whole = unsplit(models[arch])
    assert all(len(tokens) == MAX_TOKENS for tokens in expected)
    outputs = run_ranks(models[arch], split, tmp_path)
    assert [line["tokens"] for line in outputs if "tokens" in line] == expected

    # Every rank ran its own slice (rank r after ranks r+1…, mlx-lm's order) and read only
    # those layers' weights: the same bytes per layer everywhere, less than the whole model.
    ranks = {line["rank"]: line for line in outputs if "rank" in line}
    assert sorted(ranks) == list(range(len(split)))
    start = 0
    for rank in reversed(range(len(split))):
        assert ranks[rank]["slice"] == [start, start + split[rank]]
        start += split[rank]
    per_layer = {ranks[r]["layer_bytes"] / split[r] for r in ranks}
    assert len(per_layer) == 1
    assert 0 < per_layer.pop() * sum(split) < whole


def test_rank_0_serves_the_worker_api_like_an_unsplit_worker(
    models: dict[str, Path], tmp_path: Path
) -> None:
    """Rank 0 of a 2-way gemma3 split is the normal worker HTTP app (its engine, its SSE):
    temperature-0 answers, streamed and not, are the unsplit worker's, request after request."""
    import httpx

    model = models["gemma3"]
    bodies = [
        {"messages": [{"role": "user", "content": "Hello world"}], "max_tokens": 6},
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True},
        {"messages": [{"role": "user", "content": "What is the weather?"}], "max_tokens": 5},
    ]

    def answers(base: str) -> list[str]:
        out = []
        with httpx.Client(base_url=base, timeout=60) as client:
            for body in bodies:
                body = {**body, "model": model.name, "temperature": 0}
                response = client.post("/chat/completions", json=body)
                assert response.status_code == 200
                out.append(
                    response.text
                    if body.get("stream")
                    else response.json()["choices"][0]["message"]["content"]
                )
        return out

    with run_worker_in_thread(model) as (base, _):
        expected = answers(base)
    expected[1] = _stream_text(expected[1])

    port, *ring = free_ports(3)
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ring]))
    env = {**rank_env(), "MLX_HOSTFILE": str(hostfile)}
    command = [
        sys.executable,
        "-m",
        "worker.serve.split_rank",
        "--model",
        str(model),
        "--split",
        "3,3",
    ]
    follower = subprocess.Popen(command, env={**env, "MLX_RANK": "1"}, stdout=subprocess.PIPE)
    leader = subprocess.Popen(
        [*command, "--serve", "--port", str(port), "--no-warm-up"],
        env={**env, "MLX_RANK": "0"},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert leader.stdout is not None
        assert "worker listening on" in leader.stdout.readline()
        got = answers(f"http://127.0.0.1:{port}/v1")
        got[1] = _stream_text(got[1])
        assert got == expected
    finally:
        # Stopped like any worker (SIGTERM); the follower sees the group break and ends.
        leader.terminate()
        leader.wait(timeout=30)
        assert follower.wait(timeout=30) == GROUP_BROKEN


def _stream_text(sse: str) -> str:
    text = []
    for line in sse.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                text.append(choice["delta"].get("content") or "")
    assert sse.rstrip().endswith("data: [DONE]")
    return "".join(text)


def test_ranks_on_two_nodes_talk_only_through_the_pinned_tls_bridge(
    models: dict[str, Path], tmp_path: Path
) -> None:
    """Two "nodes" (two identities, one bridge server each): each rank's hostfile lists its
    own loopback port and a local bridge link for the other rank, so all ring traffic crosses
    the TLS bridge; the output is still the unsplit model's."""
    model = models["llama"]
    expected, _ = unsplit(model)
    with bridged_hostfiles() as hostfiles:
        outputs = run_ranks(model, [3, 3], tmp_path, hostfiles=hostfiles)
    assert [line["tokens"] for line in outputs if "tokens" in line] == expected
