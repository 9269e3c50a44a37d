"""GGUF → MLX conversion: read a GGUF file, write a directory that ``mlx_lm.load`` accepts.

Supported architectures: ``llama`` (Llama, SmolLM, …) and ``gemma3``. Entry point:
:func:`convert_gguf`; every failure is a :class:`ConvertError`.
"""

from worker.convert.converter import ARCHITECTURES, convert_gguf
from worker.convert.errors import ConvertError, CorruptGGUFError, UnsupportedModelError
from worker.convert.progress import NullProgress, Progress

__all__ = [
    "ARCHITECTURES",
    "ConvertError",
    "CorruptGGUFError",
    "NullProgress",
    "Progress",
    "UnsupportedModelError",
    "convert_gguf",
]
