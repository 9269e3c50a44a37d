"""``mesh models pull`` and ``mesh models list`` between two real ``mesh up`` processes.

A holds the tiny model in its store and serves it; B (no worker) joins. ``mesh models list`` on
B shows that A holds it; ``mesh models pull tiny`` on B copies it from A over the TLS side
channel (through B's running node), not from the registry; the list then shows it here too.
With A gone, B restarted with ``--model tiny`` loads the copy and answers from its own worker.
"""

from __future__ import annotations

import shutil
import sys

import httpx
import pytest
from mesh_processes import Running, run_mesh, wait_for

from worker.store import model_path


def _same_files(a, b) -> bool:  # type: ignore[no-untyped-def]
    names = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    return names == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file()) and all(
        (a / n).read_bytes() == (b / n).read_bytes() for n in names
    )


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_pull_copies_from_a_member_then_list_shows_it_and_the_node_serves_it(
    tiny_model_dir, tmp_path
):
    shutil.copytree(tiny_model_dir, model_path(tmp_path / "a", "tiny"))
    a = Running(tmp_path / "a", "--model", "tiny")
    b = None
    try:
        invite = run_mesh("invite", "--home", str(a.home), "--ttl", "10m")
        assert invite.returncode == 0, invite.stderr
        token = invite.stdout.strip().splitlines()[-1]
        b = Running(tmp_path / "b", "--no-worker", "--join", token)
        a_id = run_mesh("id", "--home", str(a.home)).stdout.strip().splitlines()[-1]

        def listed_on_b() -> str | None:
            out = run_mesh("models", "list", "--home", str(b.home)).stdout
            return out if "Held by members" in out and "tiny" in out else None

        before = wait_for(listed_on_b, 30, "A's tiny listed as held by a member on B")
        assert a_id[:12] in before and "(also here)" not in before
        assert "No models in" in before  # B's own store is empty

        pulled = run_mesh("models", "pull", "tiny", "--home", str(b.home))
        assert pulled.returncode == 0, pulled.stdout + pulled.stderr
        assert "copied tiny from the mesh" in " ".join(pulled.stdout.split())
        assert _same_files(model_path(a.home, "tiny"), model_path(b.home, "tiny"))
        assert not (model_path(b.home, "tiny").parent / ".partial" / "tiny").exists()

        after = run_mesh("models", "list", "--home", str(b.home))
        assert after.returncode == 0, after.stderr
        assert "(also here)" in after.stdout  # held by A, and now by B
        assert "Models in" in after.stdout and "llama" in after.stdout  # B's store lists it

        again = run_mesh("models", "pull", "tiny", "--home", str(b.home))
        assert again.returncode == 0 and "already in" in again.stdout

        # With A gone, only B's own worker can answer: it loads the copied model.
        print("---- node A ----\n" + a.stop())
        print("---- node B ----\n" + b.stop())
        b = Running(tmp_path / "b", "--model", "tiny")
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        response = httpx.post(b.url + "/v1/chat/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        assert response.headers["x-route"] == "local"
        assert response.json()["usage"]["completion_tokens"] > 0
    finally:
        if b is not None:
            print("---- node B ----\n" + b.stop())
        print("---- node A ----\n" + a.stop())
