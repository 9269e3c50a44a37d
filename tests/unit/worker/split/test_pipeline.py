"""The per-rank slice, in one process: skipped layers keep every cache's bookkeeping exact at no
memory, only the slice's weights are listed, and bad splits are refused. (The split across real
rank processes is tests/e2e/test_split_ring.py.)"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model

from worker.split.pipeline import (
    PipelineError,
    SkippedLayer,
    Slice,
    decoder_of,
    materialize,
    slice_model,
)
from worker.testing import make_tiny_gemma3_model, make_tiny_model


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp(request.param)
    if request.param == "llama":
        return make_tiny_model(root / "m", num_layers=4, sliding_window=3)
    return make_tiny_gemma3_model(root / "m", num_layers=6, sliding_window=3)


def test_skipped_layers_advance_their_caches_like_real_ones(model_dir: Path) -> None:
    whole, _ = load_model(model_dir)
    part, _ = load_model(model_dir, lazy=True)
    layers = decoder_of(part)["layers"]
    for i in range(len(layers) - 1):  # only the last layer really runs
        layers[i] = SkippedLayer(layers[i])
    full_cache, part_cache = make_prompt_cache(whole), make_prompt_cache(part)
    for chunk in ([1, 2, 3, 4, 5], [6], [7, 8], [9]):  # past the 3-token window
        tokens = mx.array([chunk])
        mx.eval(whole(tokens, cache=full_cache), part(tokens, cache=part_cache))
        for real, skipped in zip(full_cache, part_cache, strict=True):
            assert skipped.offset == real.offset
            assert type(skipped) is type(real)
            assert vars(skipped).get("_idx") == vars(real).get("_idx")
    assert all(c.nbytes == 0 for c in part_cache[:-1])
    assert part_cache[-1].nbytes == full_cache[-1].nbytes > 0
    # The model still reads its layers' flags through the disguise (llama: use_sliding).
    assert [type(c) for c in part.make_cache()] == [type(c) for c in full_cache]


def test_only_the_slice_weights_are_listed_and_read(model_dir: Path) -> None:
    whole, _ = load_model(model_dir, lazy=True)
    total = materialize(whole)
    part, _ = load_model(model_dir, lazy=True)
    layers = decoder_of(part)["layers"]
    for i in range(1, len(layers)):
        layers[i] = SkippedLayer(layers[i])
    per_layer = sum(v.nbytes for _, v in _flat(decoder_of(whole)["layers"][0].parameters()))
    shared = total - per_layer * len(layers)
    assert materialize(part) == shared + per_layer


def test_slice_of_follows_mlx_lm_order() -> None:
    assert Slice.of([2, 1, 3], 0) == Slice(0, 3, 4, 6)
    assert Slice.of([2, 1, 3], 1) == Slice(1, 3, 3, 4)
    assert Slice.of([2, 1, 3], 2) == Slice(2, 3, 0, 3)


def test_a_split_that_does_not_add_up_is_refused(model_dir: Path) -> None:
    model, _ = load_model(model_dir, lazy=True)
    group = mx.distributed.init()  # a singleton group without a launcher
    n = len(decoder_of(model)["layers"])
    for split in ([n - 1], [n, 1], [0]):
        with pytest.raises(PipelineError):
            slice_model(model, group, split)
    assert slice_model(model, group, [n]) == Slice(0, 1, 0, n)


def _flat(tree):
    from mlx.utils import tree_flatten

    return tree_flatten(tree)
