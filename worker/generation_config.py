"""A model's recommended sampling: what a request that leaves temperature, top_p, top_k or min_p
out gets. Imports no MLX (the model store uses it too).

Sources, first that says something wins: the model directory's ``generation_config.json`` (the
Hugging Face file; the store writes one into the models it converts from GGUF), the store's
registry entry (models pulled before the store wrote that file), else mlx-lm's own defaults
(``mlx_lm.generate``: greedy). Like vLLM's ``--generation-config auto``, only the fields a file
names are taken, the others keep the fallback's values; ``do_sample: false`` means greedy, and
``do_sample: true`` without a temperature means transformers' 1.0.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

GENERATION_CONFIG = "generation_config.json"
_FIELDS = ("temperature", "top_p", "top_k", "min_p")
_LIMITS: dict[str, tuple[float, float]] = {
    "temperature": (0.0, 2.0),
    "top_p": (1e-9, 1.0),
    "top_k": (0, 1 << 31),
    "min_p": (0.0, 1.0),
}


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """The sampling values a request gets for the fields it omits, and where they came from."""

    # mlx-lm's defaults (mlx_lm.generate DEFAULT_TEMP, DEFAULT_TOP_P, DEFAULT_TOP_K, DEFAULT_MIN_P)
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    source: str = "mlx-lm"  # "generation_config.json" | "registry" | "mlx-lm"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


MLX_LM_DEFAULTS = SamplingDefaults()


def parse_generation_config(
    data: Any, *, source: str, fallback: SamplingDefaults = MLX_LM_DEFAULTS
) -> SamplingDefaults | None:
    """The sampling a generation config (a dict) recommends, over ``fallback``; None when it
    names no sampling field (many carry only token ids). Values out of range are ignored."""
    if not isinstance(data, dict):
        return None
    values: dict[str, Any] = {}
    for name in _FIELDS:
        value = data.get(name)
        low, high = _LIMITS[name]
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if not low <= value <= high or (name == "top_k" and not float(value).is_integer()):
            log.warning("%s: ignoring %s=%r (out of range)", source, name, value)
            continue
        values[name] = int(value) if name == "top_k" else float(value)
    do_sample = data.get("do_sample")
    if do_sample is False:
        values["temperature"] = 0.0
    elif do_sample is True and "temperature" not in values:
        values["temperature"] = 1.0
    if not values:
        return None
    return replace(fallback, **values, source=source)


def read_generation_config(model_dir: Path) -> SamplingDefaults | None:
    """What ``model_dir/generation_config.json`` recommends; None when it is missing, unreadable
    or names no sampling field."""
    path = model_dir / GENERATION_CONFIG
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("cannot read %s: %s", path, exc)
        return None
    return parse_generation_config(data, source=GENERATION_CONFIG)


def resolve_sampling_defaults(
    model: str | Path, registry: dict[str, Any] | None = None
) -> SamplingDefaults:
    """The defaults of a loaded model (a directory or hub id): its generation_config.json,
    else ``registry`` (the store's recommendation), else mlx-lm's."""
    model_dir = local_model_dir(model)
    found = read_generation_config(model_dir) if model_dir is not None else None
    if found is None and registry:
        found = parse_generation_config(registry, source="registry")
    return found or MLX_LM_DEFAULTS


def local_model_dir(model: str | Path) -> Path | None:
    """Where a loaded model's files are: the directory itself, or a hub id's cached snapshot
    (``mlx_lm.load`` downloaded it; this never goes to the network)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    from mlx_lm.utils import hf_repo_to_path

    try:
        return hf_repo_to_path(str(model))
    except (OSError, ValueError) as exc:  # huggingface_hub's "not in the local cache"
        log.warning("no local snapshot of %s to read its generation config: %s", model, exc)
        return None
