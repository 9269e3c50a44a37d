"""A model's recommended sampling: generation_config.json, else the registry, else mlx-lm's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from worker import store
from worker.generation_config import (
    MLX_LM_DEFAULTS,
    SamplingDefaults,
    parse_generation_config,
    read_generation_config,
    resolve_sampling_defaults,
)


def _write(directory: Path, config: object) -> Path:
    (directory / "generation_config.json").write_text(json.dumps(config))
    return directory


def test_named_fields_are_taken_the_others_fall_back() -> None:
    qwen = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "eos_token_id": 2}
    assert parse_generation_config(qwen, source="file") == SamplingDefaults(
        temperature=0.7, top_p=0.8, top_k=20, min_p=0.0, source="file"
    )


@pytest.mark.parametrize(
    ("config", "temperature"),
    [
        ({"do_sample": False, "temperature": 0.6}, 0.0),  # greedy, as transformers would decode
        ({"do_sample": True, "top_k": 64}, 1.0),  # sampling at transformers' default temperature
        ({"temperature": 0.3}, 0.3),
    ],
)
def test_do_sample(config: dict, temperature: float) -> None:
    found = parse_generation_config(config, source="file")
    assert found is not None and found.temperature == temperature


@pytest.mark.parametrize(
    "config", [{}, {"bos_token_id": 1, "eos_token_id": 2}, [], "text", {"temperature": "hot"}]
)
def test_a_config_without_sampling_recommends_nothing(config: object) -> None:
    assert parse_generation_config(config, source="file") is None


def test_values_out_of_range_are_ignored() -> None:
    found = parse_generation_config({"temperature": 9, "top_p": 0.5, "top_k": 2.5}, source="f")
    assert found == SamplingDefaults(top_p=0.5, source="f")


def test_file_then_registry_then_mlx_lm(tmp_path: Path) -> None:
    registry = {"do_sample": True, "temperature": 0.2, "top_p": 0.9}
    assert resolve_sampling_defaults(tmp_path, registry).source == "registry"
    assert resolve_sampling_defaults(tmp_path, None) == MLX_LM_DEFAULTS
    _write(tmp_path, {"eos_token_id": 2})  # token ids only: no say on sampling
    assert resolve_sampling_defaults(tmp_path, registry).temperature == 0.2
    _write(tmp_path, {"temperature": 0.5})
    assert resolve_sampling_defaults(tmp_path, registry) == SamplingDefaults(
        temperature=0.5, source="generation_config.json"
    )


def test_an_unreadable_file_recommends_nothing(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text("{not json")
    assert read_generation_config(tmp_path) is None


@pytest.mark.parametrize("name", sorted(store.REGISTRY))
def test_every_registry_model_recommends_sampling(name: str) -> None:
    found = parse_generation_config(store.REGISTRY[name].generation_config, source="registry")
    assert found is not None and 0 < found.temperature <= 1.0


def test_smollm2_gets_its_model_card_values() -> None:
    found = parse_generation_config(
        store.REGISTRY["smollm2-135m"].generation_config, source="registry"
    )
    assert found is not None and (found.temperature, found.top_p) == (0.2, 0.9)


def test_a_hub_model_not_in_the_local_cache_gets_mlx_lm_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An empty cache; the lookup is local only (mlx-lm's hf_repo_to_path), never the network.
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    assert resolve_sampling_defaults("mlx-community/not-downloaded") == MLX_LM_DEFAULTS
