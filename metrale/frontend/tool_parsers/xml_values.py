"""Argument values written between tags, as the XML-style formats write them.

Qwen3-Coder (``<parameter=p>v</parameter>``), MiniMax (``<parameter name="p">v</parameter>``)
and Poolside (``<arg_key>p</arg_key><arg_value>v</arg_value>``) all write each value as bare
text up to a closing tag. `ValueReader` reads one such value and `ArgumentsWriter` turns the
values into one JSON object. String values stream as they arrive; other types are converted
(by the tool's schema) once the value is complete.

A value ends at its closing tag, or, when the model forgot it, at a tag that can only follow a
value (the next parameter, the end of the function). A `Boundary` can also ask for lookahead:
then the tag counts only when the right tag follows it, so a value that quotes the tags (code
that documents this very format) keeps them as text.

A value that its closing tag did not end counts its call as repaired. A value that does not
convert to its schema type stays a string and counts as parsed: the text cannot tell a model's
slip from a schema looser than it says.

`parameters_grammar` is the other direction, for grammars that force a call: it writes the
parameters of one call so that these readers convert each value back to one the schema accepts.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from metrale.frontend.tool_parsers.grammar import (
    OPTIONAL_NEWLINE,
    GrammarBuilder,
    literal,
    ordered_members,
)
from metrale.frontend.tool_parsers.names import is_valid_name
from metrale.frontend.tool_parsers.schema import ParamSchema, ToolSpec, Untyped, convert_value
from metrale.frontend.tool_parsers.sink import EventSink
from metrale.frontend.tool_parsers.tags import partial_tail_len, skip_space


class ArgumentsWriter:
    """Writes one call's arguments object, a member at a time; valid JSON after each piece
    once closed with '"}' (inside a string) or '}'."""

    def __init__(self, sink: EventSink) -> None:
        self._sink = sink
        self._num_members = 0

    def value(self, key: str, value: Any) -> None:
        self._sink.arguments(self._member_prefix(key) + json.dumps(value, ensure_ascii=False))

    def open_string(self, key: str) -> None:
        self._sink.arguments(self._member_prefix(key) + '"')

    def string_piece(self, text: str) -> None:
        # Escaping is per character, so escaping pieces equals escaping their concatenation.
        self._sink.arguments(json.dumps(text, ensure_ascii=False)[1:-1])

    def close_string(self) -> None:
        self._sink.arguments('"')

    def close(self) -> None:
        self._sink.arguments("}" if self._num_members else "{}")

    @classmethod
    def start_call(cls, sink: EventSink, name: str) -> ArgumentsWriter:
        """Open a call named `name`; its arguments go through the writer returned."""
        sink.start_call(name)
        return cls(sink)

    def end_call(self) -> None:
        """Close the arguments object, then the call."""
        self.close()
        self._sink.end_call()

    def note_repair(self) -> None:
        self._sink.note_repair()

    def _member_prefix(self, key: str) -> str:
        self._num_members += 1
        opening = "{" if self._num_members == 1 else ", "
        return opening + json.dumps(key, ensure_ascii=False) + ": "


@dataclass(frozen=True)
class Boundary:
    """A tag that ends a value.

    ``closes``: the value's own closing tag, consumed; otherwise the tag is left for the caller.
    ``followers``: when set, the tag counts only if, after whitespace, one of these or the end
    of the output follows it. ``at_line_start``: it counts only right after a newline.
    """

    tag: str
    closes: bool = False
    followers: tuple[str, ...] | None = None
    at_line_start: bool = False


@dataclass(frozen=True)
class ValueRules:
    """How a format writes values."""

    boundaries: tuple[Boundary, ...]
    # The template writes a newline after the opening tag and before the closing one; one of
    # each is layout, not value.
    trim_newline: bool
    untyped: Untyped


class ValueReader:
    """Reads one value from just after its opening tag; writes it when it ends."""

    def __init__(
        self, rules: ValueRules, key: str, schema: ParamSchema | None, writer: ArgumentsWriter
    ) -> None:
        self._rules = rules
        self._key = key
        self._schema = schema
        self._writer = writer
        self._tags = tuple(b.tag for b in rules.boundaries)
        json_type = schema.json_type if schema is not None else None
        # Only plain strings stream: anything else needs the whole text to get its type.
        self._streams = (
            json_type == "string" and not (schema is not None and schema.nullable)
        ) or (json_type is None and rules.untyped is Untyped.STRING)
        self._started = False
        self._held_newline = False  # a streamed trailing newline that may be layout
        self._last_char = ">"  # the character before the unread text, for at_line_start
        self._pieces: list[str] = []

    def read(self, text: str, pos: int, final: bool) -> tuple[int, Boundary | None, bool]:
        """(position reached, the boundary that ended the value, whether it ended).

        An ended value with no boundary ran to the end of the output.
        """
        if not self._started:
            if pos == len(text) and not final:
                return pos, None, False
            self._started = True
            if self._streams:
                self._writer.open_string(self._key)
            if self._rules.trim_newline and text.startswith("\n", pos):
                self._last_char = "\n"
                pos += 1
        search = pos
        while (hit := self._next_boundary(text, search)) is not None:
            at, boundary = hit
            verdict = self._verdict(text, pos, at, boundary, final)
            if verdict is None:  # undecided: hold from the tag on
                self._take(text[pos:at])
                return at, None, False
            if verdict:
                self._take(text[pos:at])
                self._end(closed=boundary.closes)
                return (at + len(boundary.tag) if boundary.closes else at), boundary, True
            search = at + 1
        if final:
            self._take(text[pos:])
            self._end(closed=False)
            return len(text), None, True
        end = len(text) - partial_tail_len(text, max(pos, search), self._tags)
        self._take(text[pos:end])
        return end, None, False

    def _next_boundary(self, text: str, start: int) -> tuple[int, Boundary] | None:
        best: tuple[int, Boundary] | None = None
        for boundary in self._rules.boundaries:
            at = text.find(boundary.tag, start)
            if at != -1 and (best is None or at < best[0]):
                best = (at, boundary)
        return best

    def _verdict(
        self, text: str, pos: int, at: int, boundary: Boundary, final: bool
    ) -> bool | None:
        """Whether the tag at ``at`` ends the value; None while the text cannot tell yet."""
        if boundary.at_line_start:
            before = text[at - 1] if at > pos else self._last_char
            if before != "\n":
                return False
        if boundary.followers is None:
            return True
        after = skip_space(text, at + len(boundary.tag))
        rest = text[after:]
        if not rest:
            return True if final else None
        if any(rest.startswith(tag) for tag in boundary.followers):
            return True
        if not final and any(tag.startswith(rest) for tag in boundary.followers):
            return None
        return False

    def _take(self, piece: str) -> None:
        if not piece:
            return
        self._last_char = piece[-1]
        if not self._streams:
            self._pieces.append(piece)
            return
        if self._held_newline:
            piece = "\n" + piece
        self._held_newline = self._rules.trim_newline and piece.endswith("\n")
        if self._held_newline:
            piece = piece[:-1]
        if piece:
            self._writer.string_piece(piece)

    def _end(self, closed: bool) -> None:
        if not closed:
            self._writer.note_repair()
        if self._streams:
            self._writer.close_string()
            return
        text = "".join(self._pieces)
        if self._rules.trim_newline and text.endswith("\n"):
            text = text[:-1]
        self._writer.value(self._key, convert_value(text, self._schema, self._rules.untyped))


def boundaries(
    closing: str, implicit: Sequence[str], *, lookahead: Sequence[Boundary] = ()
) -> tuple[Boundary, ...]:
    """The closing tag plus the tags that end a value missing it; ``lookahead`` overrides."""
    by_tag = {b.tag: b for b in lookahead}
    plain = [Boundary(closing, closes=True), *(Boundary(tag) for tag in implicit)]
    return tuple(by_tag.get(b.tag, b) for b in plain)


def parameters_grammar(
    grammar: GrammarBuilder,
    tool: ToolSpec,
    rules: ValueRules,
    spell: Callable[[str, str], str],
) -> str:
    """EBNF of one call's parameters: the schema's properties in their declared order, the
    required ones present. ``spell(name, value)`` writes one parameter around its value's EBNF.

    Each value is written so that `ValueReader` with ``rules`` converts it to a value of the
    parameter's type: a string as raw text in which no boundary tag occurs, any other type as
    JSON that the schema accepts (xgrammar's JSON schema support) with no boundary tag in its
    strings, an enum or const as one of its values. A string's other constraints (pattern,
    length) are not enforced, and a number past a double's range (1e999) is read back as text,
    JSON having no infinity.
    """
    properties = tool.schema.get("properties")
    required = tool.schema.get("required")
    required_names = set(required) if isinstance(required, list) else set()
    defs = {key: tool.schema[key] for key in ("$defs", "definitions") if key in tool.schema}
    members = []
    for name, schema in (properties if isinstance(properties, Mapping) else {}).items():
        if not is_valid_name(name):
            if name in required_names:
                raise ValueError(
                    f"required parameter {name!r} of {tool.name} cannot be written in this "
                    f"tool-call format: its name has spaces, quotes, brackets or one of <>=,;"
                )
            continue
        schema = {**schema, **defs} if isinstance(schema, Mapping) else {}
        param = tool.params.get(name, ParamSchema(None))
        members.append((spell(name, _value(grammar, rules, schema, param)), name in required_names))
    return ordered_members(grammar, members)


def _value(
    grammar: GrammarBuilder, rules: ValueRules, schema: Mapping[str, Any], param: ParamSchema
) -> str:
    stops = [boundary.tag for boundary in rules.boundaries]
    choices = _choice_texts(schema, param, rules, stops)
    if choices:
        value = "(" + " | ".join(literal(text) for text in choices) + ")"
    elif param.json_type in (None, "string"):
        value = grammar.text_excluding(stops)
    elif param.json_type == "boolean":  # the Qwen3-Coder template writes Python's True/False
        words = ["true", "false", "True", "False", *(["null"] if param.nullable else [])]
        value = "(" + " | ".join(literal(word) for word in words) + ")"
    else:
        value = grammar.json_value(_held_to_type(schema, param), excludes=stops)
    if rules.trim_newline:
        return f"{OPTIONAL_NEWLINE} {value} {OPTIONAL_NEWLINE}"
    return value


def _choice_texts(
    schema: Mapping[str, Any], param: ParamSchema, rules: ValueRules, stops: Sequence[str]
) -> list[str]:
    """How to write each value of an enum or const, raw if the reader keeps it, else as JSON;
    values the format cannot write are left out."""
    if "const" in schema:
        values = [schema["const"]]
    elif isinstance(schema.get("enum"), list):
        values = schema["enum"]
    else:
        return []
    texts = []
    for value in values:
        for text in [*([value] if isinstance(value, str) else []), _json(value)]:
            if (
                not any(stop in text for stop in stops)
                and not (rules.trim_newline and (text.startswith("\n") or text.endswith("\n")))
                and _json(convert_value(text, param, rules.untyped)) == _json(value)
            ):
                texts.append(text)
                break
    return texts


def _held_to_type(schema: Mapping[str, Any], param: ParamSchema) -> Mapping[str, Any]:
    """The schema, less the types the reader would not convert the value to."""
    wanted = {param.json_type, *(["null"] if param.nullable else [])}
    declared = schema.get("type")
    if isinstance(declared, list):
        return {**schema, "type": [t for t in declared if t in wanted]}
    for key in ("anyOf", "oneOf"):
        options = schema.get(key)
        if isinstance(options, list):
            kept = [o for o in options if isinstance(o, Mapping) and o.get("type") in wanted]
            if kept:
                return {**schema, key: kept}
    return schema


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, sort_keys=True)
