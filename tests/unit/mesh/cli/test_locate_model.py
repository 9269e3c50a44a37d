"""``mesh up --home DIR --model NAME``: a store name missing from DIR's store is found in the
default store, else pulled into DIR; one line says which."""

from __future__ import annotations

from pathlib import Path

import pytest

from mesh.cli.models import locate_store_model


def _stored(home: Path, name: str) -> Path:
    path = home / "models" / name
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    return path


def _no_pull(name: str) -> Path:
    raise AssertionError(f"pulled {name}")


def test_a_name_in_the_home_store_is_served_from_there(tmp_path):
    home, default = tmp_path / "home", tmp_path / "default"
    _stored(home, "smollm2-135m")
    _stored(default, "smollm2-135m")
    assert locate_store_model(home, default, "smollm2-135m", _no_pull) == ("smollm2-135m", None)


def test_a_name_only_in_the_default_store_is_served_from_it_in_one_line(tmp_path):
    home, default = tmp_path / "home", tmp_path / "default"
    there = _stored(default, "smollm2-135m")
    model, said = locate_store_model(home, default, "smollm2-135m", _no_pull)
    assert model == str(there)
    assert said is not None and str(there) in said and "\n" not in said


def test_a_registry_name_in_no_store_is_pulled_into_the_home(tmp_path):
    home, default = tmp_path / "home", tmp_path / "default"
    pulled: list[str] = []

    def pull(name: str) -> Path:
        pulled.append(name)
        return _stored(home, name)

    model, said = locate_store_model(home, default, "smollm2-135m", pull)
    assert pulled == ["smollm2-135m"] and model == "smollm2-135m"
    assert said is not None and "pulled" in said


@pytest.mark.parametrize("name", ["llama-9000", "mlx-community/some-model"])
def test_unknown_names_and_hub_ids_are_left_to_the_worker_checks(tmp_path, name):
    assert locate_store_model(tmp_path / "a", tmp_path / "b", name, _no_pull) == (name, None)


def test_the_default_store_is_not_its_own_fallback(tmp_path):
    pulled: list[str] = []
    _, said = locate_store_model(
        tmp_path, tmp_path, "smollm2-135m", lambda n: pulled.append(n) or tmp_path
    )
    assert pulled == ["smollm2-135m"] and said is not None  # not "found" in its own empty store
