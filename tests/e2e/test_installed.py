"""An installed copy works, not only a checkout: build the wheel, install it into a fresh venv
outside the checkout, then run ``mesh``, load a bundled lab scenario and start a node whose console
page and static files load over HTTP.

The fresh venv reuses this environment's third-party packages (mlx, starlette, …) through a
``.pth`` line that names our site-packages directory, so no dependency is downloaded again. A
plain path line does not run the ``.pth`` files in that directory, so the editable install's
finder that maps ``worker`` and friends to the checkout stays off: they resolve to the wheel's
copies, and the test asserts so.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import sysconfig
from pathlib import Path

import httpx
import orjson
import pytest
from mesh_processes import wait_for

ROOT = Path(__file__).parents[2]
PACKAGES = ("mesh", "gateway", "worker", "lab")
STATIC = ROOT / "gateway" / "static"


def _run(argv: list[str | Path], cwd: Path, env: dict[str, str], timeout: float = 120) -> str:
    done = subprocess.run(
        [str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, f"{argv}: {done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """(the fresh venv's bin directory, an environment for it) with the wheel installed."""
    work = tmp_path_factory.mktemp("installed")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env |= {"MLX_MESH_HOME": str(work / "home"), "COLUMNS": "200"}
    # Build from a copy of the sources: setuptools builds in place and would pack whatever an
    # earlier build left in build/lib, hiding a data file the package-data no longer names.
    source = work / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "out")
    for package in PACKAGES:
        shutil.copytree(ROOT / package, source / package, ignore=skip)
    wheels = work / "wheels"
    pip = [sys.executable, "-m", "pip"]
    _run([*pip, "wheel", source, "--no-deps", "-q", "-w", wheels], work, env, timeout=300)
    (wheel,) = wheels.glob("mlx_mesh-*.whl")

    venv = work / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], work, env)
    python = venv / "bin" / "python"
    _run([*pip, "--python", python, "install", "-q", "--no-deps", "--no-index", wheel], work, env)
    purelib = _run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], work, env
    )
    (Path(purelib.strip()) / "dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return venv / "bin", env


def test_the_installed_packages_resolve_into_the_venv_not_the_checkout(installed) -> None:
    bin_dir, env = installed
    where = _run(
        [
            bin_dir / "python",
            "-c",
            "import sysconfig, importlib; print(sysconfig.get_path('purelib')); "
            f"[print(importlib.import_module(m).__file__) for m in {PACKAGES!r}]",
        ],
        bin_dir.parent.parent,
        env,
    ).split()
    site, files = Path(where[0]), [Path(f) for f in where[1:]]
    assert len(files) == len(PACKAGES)
    for file in files:
        assert file.is_relative_to(site) and not file.is_relative_to(ROOT), file


def test_mesh_help_and_a_bundled_scenario_load_from_the_installed_copy(installed) -> None:
    bin_dir, env = installed
    cwd = bin_dir.parent.parent
    assert "lab" in _run([bin_dir / "mesh", "--help"], cwd, env)
    listing = _run([bin_dir / "mesh", "lab", "scenarios"], cwd, env)
    assert "kill-restart" in listing and "partition-heal" in listing
    loaded = _run(
        [
            bin_dir / "python",
            "-c",
            "from lab.scenario import load_scenario; print(load_scenario('kill-restart').name)",
        ],
        cwd,
        env,
    )
    assert loaded.strip() == "kill-restart"


def test_an_installed_node_serves_its_console_and_static_files(installed, tiny_model_dir) -> None:
    bin_dir, env = installed
    home = bin_dir.parent.parent / "node-home"
    node = subprocess.Popen(
        [
            bin_dir / "mesh",
            "up",
            "--model",
            str(tiny_model_dir),
            "--home",
            str(home),
            "--port",
            "0",
            "--mesh-host",
            "127.0.0.1",
            "--mesh-port",
            "0",
            "--no-discovery",
        ],
        cwd=bin_dir.parent.parent,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:

        def ready() -> dict | None:
            assert node.poll() is None, node.communicate()[0].decode(errors="replace")
            node_file = home / "node.json"
            return orjson.loads(node_file.read_bytes()) if node_file.exists() else None

        url = wait_for(ready, 60, "the installed node's node.json")["url"]
        page = httpx.get(url + "/", timeout=10)
        assert page.status_code == 200 and page.content == (STATIC / "index.html").read_bytes()
        for asset in sorted(p.name for p in STATIC.iterdir()):
            served = httpx.get(f"{url}/static/{asset}", timeout=10)
            assert served.status_code == 200, asset
            assert served.content == (STATIC / asset).read_bytes(), asset
    finally:
        if node.poll() is None:
            node.send_signal(signal.SIGTERM)
        output = node.communicate(timeout=30)[0].decode(errors="replace")
    assert node.returncode == 0, output
