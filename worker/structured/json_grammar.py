"""JSON schema → llguidance grammar, checked before any generation starts (no MLX, no model).

``json_grammar(schema)`` compiles a JSON schema (None: any JSON object, OpenAI's
``json_object``) into the grammar text an ``llguidance.LLMatcher`` takes, and validates it
against a byte-level tokenizer, so unsupported keywords (``uniqueItems``, ``not``, ``if``…),
bad references and unsatisfiable schemas are refused here with a ``SchemaError`` that names
where in the schema the problem is. The gateway calls it to answer 400 in each API's shape;
the worker calls it too (it also serves clients directly) and then builds the matcher with the
model's own tokenizer (worker/structured/processor.py).

The JSON is written on one line with ``", "`` and ``": "`` between items, and no other
whitespace: the way models usually write it, and a grammar that allowed free whitespace
would let a weak model pad forever instead of ending the value.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import llguidance
import orjson
from llguidance._tokenizer import TokenizerWrapper

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# Applied after the schema's own "x-guidance" options: a schema cannot loosen them (``lenient``
# would silently ignore the keywords it does not implement, and the output would not validate).
GRAMMAR_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    "lenient": False,
    "coerce_one_of": False,
}

ANY_OBJECT: dict[str, Any] = {"type": "object"}


class SchemaError(ValueError):
    """A schema that cannot be held to: ``path`` is where in the schema (keys and indices)."""

    def __init__(self, message: str, path: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.message = message
        self.path = path

    def param(self, prefix: str) -> str:
        """The field to name in an error, below ``prefix`` (where the schema is in the body)."""
        return ".".join((prefix, *self.path))


class _ByteTokens:
    """256 one-byte tokens and an end token: enough for llguidance to check a grammar fully
    (unsatisfiable ranges included) without the model's tokenizer."""

    def __init__(self) -> None:
        self.eos_token_id = 256
        self.bos_token_id = None
        self.tokens = [bytes([b]) for b in range(256)] + [b"<eos>"]
        self.special_token_ids = [256]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


@functools.cache
def validator_tokenizer() -> llguidance.LLTokenizer:
    """A byte-level tokenizer that checks grammars without any model."""
    return llguidance.LLTokenizer(TokenizerWrapper(_ByteTokens()))


def json_grammar(schema: dict[str, Any] | None) -> str:
    """The llguidance grammar for ``schema`` (None: any JSON object); SchemaError when it has a
    feature that cannot be enforced or cannot be satisfied. Compiled grammars are cached by the
    schema's JSON text: clients send the same schema again and again, and a large one takes
    long enough (~0.4 s for 150 kB) to matter on the gateway's event loop."""
    try:
        text = orjson.dumps(ANY_OBJECT if schema is None else schema)
    except orjson.JSONEncodeError as exc:
        raise SchemaError(f"not a usable JSON schema: {exc}") from exc
    return _compiled(text)


def is_panic(exc: BaseException) -> bool:
    """A Rust panic inside llguidance: pyo3 raises it as ``PanicException``, a BaseException
    (not an Exception), which nothing else here would catch. Version 1.9.1 panics, for one,
    formatting some errors about schemas with non-ASCII text."""
    return type(exc).__name__ == "PanicException"


@functools.lru_cache(maxsize=256)
def _compiled(text: bytes) -> str:
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            text.decode(), overrides=GRAMMAR_OPTIONS
        )
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, validator_tokenizer()
        )
    except ValueError as exc:
        raise SchemaError(f"not a usable JSON schema: {exc}") from exc
    except BaseException as exc:
        if not is_panic(exc):
            raise
        raise SchemaError(
            f"the grammar library failed on this schema: {_one_line(str(exc))}"
        ) from None
    if is_error:
        message = messages[0] if messages else "invalid schema"
        raise SchemaError(_one_line(message), locate(orjson.loads(text), message))
    return grammar


def _one_line(message: str) -> str:
    return " ".join(message.split())


# llguidance's messages say what is wrong, not where: each pattern finds the place in the
# schema (the first one in document order). Unknown messages name the schema itself.
def _key_finder(names: str) -> Callable[[dict[str, Any]], str | None]:
    wanted = re.findall(r'"([^"]+)"', names)
    return lambda node: next((key for key in wanted if key in node), None)


def _value_finder(key: str, value: str) -> Callable[[dict[str, Any]], str | None]:
    return lambda node: key if node.get(key) == value else None


def _property_finder(name: str) -> Callable[[dict[str, Any]], str | None]:
    def find(node: dict[str, Any]) -> str | None:
        properties = node.get("properties")
        if isinstance(properties, dict) and name in properties and name in node.get("required", ()):
            return f"properties.{name}"
        return None

    return find


_LOCATORS: list[tuple[re.Pattern[str], Callable[[str], Callable[[dict[str, Any]], str | None]]]] = [
    (re.compile(r"Unimplemented keys: \[(.*?)\]"), _key_finder),
    (re.compile(r"Unknown format: (\S+)"), lambda v: _value_finder("format", v)),
    (re.compile(r"Invalid type: (\S+)"), lambda v: _value_finder("type", v)),
    (re.compile(r"Pointer '(.*?)' does not exist"), lambda v: _value_finder("$ref", "#" + v)),
    (re.compile(r"required property '(.*?)' is unsatisfiable"), _property_finder),
]


def locate(schema: Any, message: str) -> tuple[str, ...]:
    """Where in ``schema`` llguidance's ``message`` points: a path of keys and indices, ending
    with the offending keyword when one is named; () when it cannot tell."""
    for pattern, make in _LOCATORS:
        if (match := pattern.search(message)) is None:
            continue
        finder = make(match.group(1))
        for path, node in _nodes(schema, ()):
            if (key := finder(node)) is not None:
                return (*path, *key.split("."))
    for path, node in _nodes(schema, ()):
        pattern_text = node.get("pattern")
        if isinstance(pattern_text, str) and pattern_text and pattern_text in message:
            return (*path, "pattern")
    return ()


# Keys whose value maps names to schemas, and keys whose value is data, not a schema.
_NAME_MAPS = frozenset({"properties", "$defs", "definitions", "patternProperties"})
_DATA = frozenset({"enum", "const", "default", "examples", "required"})


def _nodes(value: Any, path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], dict[str, Any]]]:
    """Every (sub)schema in ``value`` with its path, in document order (parents first). A stack,
    not recursion: a schema may nest deeper than Python's recursion limit."""
    stack: list[tuple[tuple[str, ...], Any]] = [(path, value)]
    while stack:
        where, node = stack.pop()
        children: list[tuple[tuple[str, ...], Any]] = []
        if isinstance(node, list):
            children = [((*where, str(i)), child) for i, child in enumerate(node)]
        elif isinstance(node, dict):
            yield where, node
            for key, child in node.items():
                if key in _DATA:
                    continue
                if key in _NAME_MAPS and isinstance(child, dict):
                    children += [((*where, key, str(n)), schema) for n, schema in child.items()]
                else:
                    children.append(((*where, str(key)), child))
        stack.extend(reversed(children))
