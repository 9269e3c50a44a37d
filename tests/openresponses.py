"""The vendored Open Responses spec (tests/fixtures/openresponses/openapi.json) as validators.

OpenAPI 3.1 schemas are JSON Schema 2020-12 (``discriminator`` is only an annotation), so the
document goes into a ``referencing`` registry as one 2020-12 resource and every
``#/components/schemas/...`` reference resolves inside it.

- :func:`check_response` / :func:`check_event`: the spec's own verdict (every error listed).
- :func:`undeclared_fields`: our stricter check where the spec leaves objects open (it never says
  ``additionalProperties: false``): every field we emit must be one the schema defines.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

SPEC_PATH = Path(__file__).parent / "fixtures" / "openresponses" / "openapi.json"
SPEC: dict[str, Any] = json.loads(SPEC_PATH.read_text(encoding="utf-8"))
_URI = "urn:openresponses:openapi"
_REGISTRY: Registry = Registry().with_resource(
    _URI, Resource.from_contents(SPEC, default_specification=DRAFT202012)
)
RESPONSE = "/components/schemas/ResponseResource"
STREAM = "/paths/~1responses/post/responses/200/content/text~1event-stream/schema"

# Fields we emit on purpose although the spec does not define them, each with its reason.
DELIBERATE_EXTRAS = {
    # OpenAI's SDK (openai.types.responses.ResponseUsage) requires it; strict clients fail without.
    "usage.input_tokens_details.cache_write_tokens",
}


@cache
def validator(pointer: str) -> Draft202012Validator:
    """A validator for the schema at JSON ``pointer`` in the spec (``/components/schemas/X``)."""
    return Draft202012Validator({"$ref": f"{_URI}#{pointer}"}, registry=_REGISTRY)


def _errors(instance: Any, pointer: str) -> list[str]:
    found = sorted(validator(pointer).iter_errors(instance), key=lambda e: list(e.absolute_path))
    return [f"{'.'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}" for e in found]


@cache
def event_schemas() -> dict[str, str]:
    """Stream event ``type`` → the pointer of its schema, from the ``text/event-stream`` oneOf."""
    out = {}
    for branch in _at(STREAM)["oneOf"]:
        pointer = branch["$ref"].removeprefix("#")
        out[_at(pointer)["properties"]["type"]["enum"][0]] = pointer
    return out


def check_response(response: Any) -> None:
    """``response`` is a valid ``ResponseResource`` that carries only fields the spec defines."""
    errors = _errors(response, RESPONSE)
    errors += [f"{path}: not defined by the spec" for path in undeclared_fields(response, RESPONSE)]
    assert not errors, "\n".join(errors)


def check_event(event: Any) -> None:
    """``event`` is one of the spec's stream events (by its ``type``, and against the oneOf); a
    response in it passes :func:`check_response`; an item in it carries only defined fields."""
    kind = event.get("type") if isinstance(event, dict) else None
    assert kind in event_schemas(), f"{kind!r} is not a stream event type of the spec"
    errors = _errors(event, event_schemas()[kind]) or _errors(event, STREAM)
    assert not errors, f"{kind}:\n" + "\n".join(errors)
    if "response" in event:
        check_response(event["response"])
    if "item" in event:
        extra = undeclared_fields(event["item"], "/components/schemas/ItemField")
        assert not extra, f"{kind}: item fields not defined by the spec: {extra}"


def undeclared_fields(instance: Any, pointer: str) -> list[str]:
    """Dotted paths of fields in ``instance`` that the schema at ``pointer`` does not define
    (its ``properties``), walking into properties, array items and the matching ``anyOf``/
    ``oneOf`` branch; :data:`DELIBERATE_EXTRAS` are left out."""
    return [path for path in _undeclared(instance, pointer, ()) if path not in DELIBERATE_EXTRAS]


def _undeclared(instance: Any, pointer: str, path: tuple[str, ...]) -> Iterator[str]:
    schema = _at(pointer)
    if "$ref" in schema:
        yield from _undeclared(instance, schema["$ref"].removeprefix("#"), path)
        return
    for key in ("anyOf", "oneOf"):
        for i in range(len(schema.get(key, []))):
            branch = f"{pointer}/{key}/{i}"
            if validator(branch).is_valid(instance):
                yield from _undeclared(instance, branch, path)
                return
    if isinstance(instance, dict) and "properties" in schema:
        for name, value in instance.items():
            if name not in schema["properties"]:
                yield ".".join((*path, name))
            else:
                yield from _undeclared(value, f"{pointer}/properties/{name}", (*path, name))
    elif isinstance(instance, list) and "items" in schema:
        for value in instance:
            # list indexes are left out of the path: DELIBERATE_EXTRAS name fields, not places
            yield from _undeclared(value, f"{pointer}/items", path)


def _at(pointer: str) -> dict[str, Any]:
    node: Any = SPEC
    for step in pointer.strip("/").split("/"):
        key = step.replace("~1", "/").replace("~0", "~")
        node = node[int(key)] if isinstance(node, list) else node[key]
    return node


def sse_events(raw: bytes) -> list[dict[str, Any]]:
    """The events of a Responses SSE body; each frame's ``event:`` name must be its ``type``."""
    out = []
    for block in raw.decode().split("\n\n"):
        lines = [line for line in block.split("\n") if line and not line.startswith(":")]
        if not lines:
            continue
        fields = dict(line.split(": ", 1) for line in lines)
        event = json.loads(fields["data"])
        assert fields.get("event") == event["type"], fields
        out.append(event)
    return out
