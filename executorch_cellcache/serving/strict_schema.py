"""``"strict": true`` in ``response_format.json_schema``: OpenAI's structured
output rules applied to the schema before it is compiled.

OpenAI's strict mode promises a reply with exactly the keys the schema
names; its API refuses a strict schema whose objects do not say so
themselves (``additionalProperties: false`` in every object, every property
in ``required``), and its Python SDK writes both into a schema it derives
from a type. This server takes the SDK's side for what a schema leaves
unsaid and the API's side for what contradicts strictness: see
``strict_schema``.
"""

from typing import Any

# Keywords whose value is a map of subschemas, one subschema, or a list of them.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_ONE = ("items", "additionalItems", "contains", "not", "if", "then", "else",
               "propertyNames", "unevaluatedItems", "unevaluatedProperties")
_SCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems", "items")


def strict_schema(schema: dict) -> dict:
    """The schema a strict ``json_schema`` is compiled with (a new dict; the
    argument is left as it was). In every object schema, at any depth (under
    ``properties``, ``items``, ``anyOf``/``oneOf``/``allOf``, ``$defs`` and
    the other subschema keywords):

    - ``additionalProperties`` left unset becomes ``false``: the reply has no
      key the object does not name in ``properties`` (or match by
      ``patternProperties``);
    - every key of ``properties`` is required (OpenAI: "all fields must be
      required"; an optional field is written as a union with null, e.g.
      ``{"type": ["string", "null"]}``); keys ``required`` already lists stay.

    An object schema is one whose ``type`` is or includes ``"object"``, or
    that has ``properties`` and no ``type``. Other keywords are left as they
    are (the grammar layer enforces what it supports and refuses the rest with a
    400, strict or not): this is not OpenAI's list of supported keywords.
    ``allOf`` members are made strict one by one, so an object split over
    ``allOf`` parts admits only the keys every part names (OpenAI's strict
    mode does not take ``allOf`` either).

    Example: ``{"type": "object", "properties": {"a": {"type": "integer"},
    "b": {"type": "string"}}}`` becomes the same with ``"required": ["a",
    "b"], "additionalProperties": false``: ``{"a": 1, "b": "x"}`` is the
    only shape of reply, ``{"a": 1}`` and ``{"a": 1, "b": "x", "c": 2}`` are
    not.

    ValueError (a path to the object, as a JSON pointer) for an object that
    sets ``additionalProperties`` to anything but false, which strict mode
    contradicts (OpenAI's API refuses it too).
    """
    return _strict(schema, "#")


def _strict(schema: Any, path: str) -> Any:
    if not isinstance(schema, dict):
        return schema   # true / false schemas, and what the grammar layer will refuse itself
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _strict(sub, f"{path}/{key}/{name}")
                        for name, sub in out[key].items()}
    for key in _SCHEMA_ONE:
        if isinstance(out.get(key), dict):
            out[key] = _strict(out[key], f"{path}/{key}")
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_strict(sub, f"{path}/{key}/{i}") for i, sub in enumerate(out[key])]
    if _is_object_schema(out):
        if out.get("additionalProperties", False) is not False:
            raise ValueError(f"strict json_schema: {path} sets additionalProperties to "
                             f"{out['additionalProperties']!r}; strict mode allows only the "
                             f"keys an object names (leave it unset or false, or drop strict)")
        out["additionalProperties"] = False
        out["required"] = _all_required(out)
    return out


def _is_object_schema(schema: dict) -> bool:
    kind = schema.get("type")
    if kind is None:
        return "properties" in schema
    return kind == "object" or (isinstance(kind, list) and "object" in kind)


def _all_required(schema: dict) -> Any:
    """Every property, in the schema's order, then whatever else ``required``
    listed (kept: dropping it would loosen the schema). A ``properties`` or
    ``required`` that is not a map or a list is left for the grammar layer to refuse."""
    props, given = schema.get("properties", {}), schema.get("required", [])
    if not isinstance(props, dict) or not isinstance(given, list):
        return given
    return list(props) + [r for r in given if r not in props]
