"""Errors the GGUF converter raises.

ConvertError                 root: anything that stops a conversion
├── CorruptGGUFError         not a GGUF file, truncated, or inconsistent
└── UnsupportedModelError    a valid GGUF the converter cannot turn into MLX
                             (architecture, tokenizer or tensor type it does not know)
"""

from __future__ import annotations


class ConvertError(Exception):
    """A GGUF file could not be converted into an MLX model directory."""


class CorruptGGUFError(ConvertError):
    """The file is not a readable GGUF (wrong magic, truncated, bad tensor table)."""


class UnsupportedModelError(ConvertError):
    """The GGUF is valid but uses an architecture, tokenizer or tensor type we cannot convert."""
