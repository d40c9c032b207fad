"""A check of a JSON value against the JSON schema keywords the tool-call tests use."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def assert_valid(value: Any, schema: Mapping[str, Any], where: str) -> None:
    """Raise AssertionError (naming ``where``) if ``value`` breaks ``schema``: type, enum,
    anyOf, minimum/maximum, properties, required, additionalProperties and items."""
    if "enum" in schema:
        assert value in schema["enum"] and type(value) in {type(v) for v in schema["enum"]}, where
    if "anyOf" in schema:
        errors = 0
        for option in schema["anyOf"]:
            try:
                assert_valid(value, option, where)
            except AssertionError:
                errors += 1
        assert errors < len(schema["anyOf"]), where
    declared = schema.get("type")
    if declared is not None:
        types = declared if isinstance(declared, list) else [declared]
        assert any(_is_type(value, t) for t in types), f"{where}: {value!r} is not {types}"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        assert schema.get("minimum", value) <= value <= schema.get("maximum", value), where
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        for name in schema.get("required", []):
            assert name in value, f"{where}: {name} is required"
        for name, item in value.items():
            if name in properties:
                assert_valid(item, properties[name], where)
            else:
                assert schema.get("additionalProperties", True) is not False, f"{where}: {name}"
    if isinstance(value, list) and "items" in schema:
        for item in value:
            assert_valid(item, schema["items"], where)


def _is_type(value: Any, json_type: str) -> bool:
    checks = {
        "string": lambda v: isinstance(v, str),
        "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        "boolean": lambda v: isinstance(v, bool),
        "object": lambda v: isinstance(v, dict),
        "array": lambda v: isinstance(v, list),
        "null": lambda v: v is None,
    }
    return checks[json_type](value)
