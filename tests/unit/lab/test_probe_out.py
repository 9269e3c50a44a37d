"""Probe output without ``--out``: the checkout's git-ignored lab/out, or the current directory
for an installed copy (never inside site-packages)."""

from __future__ import annotations

from pathlib import Path

from lab.probe import default_out


def test_a_checkout_writes_to_lab_out():
    here = Path(__file__).resolve().parents[3] / "lab"
    assert default_out(here) == here / "out"


def test_an_installed_copy_writes_to_the_current_directory(tmp_path, monkeypatch):
    installed = tmp_path / "site-packages" / "lab"
    installed.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert default_out(installed) == tmp_path / "lab-out"
