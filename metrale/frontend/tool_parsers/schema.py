"""Tool schemas, reduced to what parsers need: each parameter's JSON type.

XML-style formats (Qwen3-Coder, MiniMax, Poolside) write every argument value as bare text;
the tool's JSON schema says whether ``3`` is the integer 3 or the string "3". The schema is
resolved once per request into `ToolSpec`s, and `convert_value` applies it per value.
"""

from __future__ import annotations

import ast
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

_JSON_TYPES = frozenset({"string", "integer", "number", "boolean", "object", "array", "null"})
_INTEGER = re.compile(r"-?(?:0|[1-9][0-9]*)")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
# Python literals are parsed only up to this size: ast.literal_eval on huge input is slow.
MAX_LITERAL_CHARS = 100_000


@dataclass(frozen=True)
class ParamSchema:
    """One parameter's JSON type; ``json_type`` is None when the schema does not say."""

    json_type: str | None
    nullable: bool = False


@dataclass(frozen=True)
class ToolSpec:
    """A function: its parameters' types, and its parameters' JSON schema as the request gave
    it (`schema`, which grammars that force a call follow)."""

    name: str
    params: Mapping[str, ParamSchema] = field(default_factory=dict)
    schema: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_openai(cls, tool: Mapping[str, Any]) -> ToolSpec:
        """From an OpenAI tool ({"type": "function", "function": {...}}) or a bare function."""
        function = tool.get("function", tool)
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise ValueError(f"tool {tool!r} has no function name: expected {{'name': ...}}")
        parameters = function.get("parameters")
        properties = parameters.get("properties") if isinstance(parameters, Mapping) else None
        params = {
            name: _param_schema(schema)
            for name, schema in (properties or {}).items()
            if isinstance(name, str)
        }
        return cls(function["name"], params, parameters if isinstance(parameters, Mapping) else {})


def tool_specs(tools: Sequence[Mapping[str, Any]]) -> list[ToolSpec]:
    """The specs of a request's OpenAI ``tools``."""
    return [ToolSpec.from_openai(tool) for tool in tools]


def _param_schema(schema: object) -> ParamSchema:
    if not isinstance(schema, Mapping):
        return ParamSchema(None)
    declared = schema.get("type")
    if isinstance(declared, str):
        types = [declared]
    elif isinstance(declared, list):
        types = [t for t in declared if isinstance(t, str)]
    elif isinstance(schema.get("anyOf") or schema.get("oneOf"), list):
        options = schema.get("anyOf") or schema.get("oneOf")
        types = [
            o["type"] for o in options if isinstance(o, Mapping) and isinstance(o.get("type"), str)
        ]
    elif "properties" in schema:
        types = ["object"]
    elif "items" in schema:
        types = ["array"]
    else:
        types = []
    types = [t.lower() for t in types if t.lower() in _JSON_TYPES]
    nullable = "null" in types
    concrete = [t for t in types if t != "null"]
    if concrete:
        return ParamSchema(concrete[0], nullable)
    return ParamSchema("null" if nullable else None, nullable)


class Untyped(Enum):
    """What a format makes of a value whose type no schema gives."""

    STRING = "string"  # keep the text (Qwen3-Coder, MiniMax: their templates write strings raw)
    JSON = "json"  # parse it as JSON or a Python literal if it is one (GLM / Poolside)


def convert_value(text: str, schema: ParamSchema | None, untyped: Untyped) -> Any:
    """The JSON value of a parameter written as bare text; anything unparseable stays a string.

    String-typed text is returned exactly as written; other types ignore surrounding
    whitespace. The result always serializes with ``json.dumps(allow_nan=False)``.
    """
    json_type = schema.json_type if schema is not None else None
    stripped = text.strip()
    if schema is not None and schema.nullable and stripped in ("null", "None"):
        return None
    if json_type is None:
        return text if untyped is Untyped.STRING else _parse_any(text)
    if json_type == "string":
        return text
    if json_type == "null":
        return None if stripped in ("null", "None") else text
    if json_type == "integer":
        return int(stripped) if _INTEGER.fullmatch(stripped) else text
    if json_type == "number":
        if not _NUMBER.fullmatch(stripped):
            return text
        number = json.loads(stripped)
        return number if math.isfinite(number) else text
    if json_type == "boolean":
        # The Qwen3-Coder template renders Python booleans with `| string`: True / False.
        lowered = stripped.lower()
        return lowered == "true" if lowered in ("true", "false") else text
    container = dict if json_type == "object" else list
    parsed, value = _parse_structured(stripped)
    return value if parsed and isinstance(value, container) else text


def _parse_any(text: str) -> Any:
    parsed, value = _parse_structured(text.strip())
    return value if parsed else text


def _parse_structured(text: str) -> tuple[bool, Any]:
    """(whether ``text`` is JSON, else a Python literal such as templates render dicts with
    ``| string``; its value, which must itself serialize as JSON)."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        if not 0 < len(text) <= MAX_LITERAL_CHARS:
            return False, None
        try:
            value = ast.literal_eval(text)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return False, None
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return False, None  # a set, bytes, NaN: not JSON
    return True, value
