"""Grammars that force a reply to be tool calls: the parts every format shares.

Each format's parser class owns its grammar (`ToolParser.call_grammar`), an EBNF text in
xgrammar's dialect written against the syntax its own reader accepts, so that whatever the
grammar lets a model write parses back into exactly one call to one of the tools, or, where
several are allowed, into one or more such calls. Layout the template writes and the parser
skips (a newline between tags) is allowed, never required.

`GrammarBuilder` collects the rules of one grammar: its own, and those xgrammar derives from a
JSON schema (arguments, typed values), renamed apart so that any number of them can be
embedded. `ordered_members` writes an object's members in their declared order, with the
required ones present; `repeat_calls` repeats a call when several are allowed.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from metrale.frontend.tool_parsers.names import is_valid_name
from metrale.frontend.tool_parsers.schema import ToolSpec

OPTIONAL_NEWLINE = '"\\n"?'

_RULE_START = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*) ::= ", re.MULTILINE)
# The pieces of a rule body: strings and character classes whole (a name inside them is text),
# names, and single characters.
_BODY_TOKEN = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|[A-Za-z_][A-Za-z0-9_]*|.', re.S)
# A rule of xgrammar's bounded whitespace (max_whitespace_cnt=1): one optional character.
_OPTIONAL_WHITESPACE = '("" | ([ \\n\\r\\t]))'
_SHARED_PREFIX = "basic_"


def literal(text: str) -> str:
    """An EBNF string literal: xgrammar reads JSON's escapes."""
    return json.dumps(text, ensure_ascii=False)


class GrammarBuilder:
    """The rules of one grammar; `build` writes it out under a root rule.

    Rule names stay unique: each embedded grammar's rules get a prefix of their own, except
    xgrammar's ``basic_*`` JSON rules, which every JSON grammar it writes spells alike and all
    embeddings then share.
    """

    def __init__(self) -> None:
        self._rules: dict[str, str] = {}
        self._ids = itertools.count()
        self._roots: dict[str, str] = {}  # embedded text or JSON schema -> its root rule

    def rule(self, hint: str, body: str) -> str:
        """Add a rule; returns its name."""
        name = f"{hint}_{next(self._ids)}"
        self._rules[name] = body
        return name

    def text_excluding(self, stops: Sequence[str]) -> str:
        """A rule for any text (the empty text too) in which none of ``stops`` occurs."""
        key = "\0".join(("text", *stops))
        if key not in self._roots:
            excludes = ", ".join(literal(stop) for stop in stops)
            body = f"TagDispatch(loop_after_dispatch=false, excludes=({excludes}))"
            self._roots[key] = self.rule("text", body)
        return self._roots[key]

    def json_value(self, schema: Mapping[str, Any], excludes: Sequence[str] = ()) -> str:
        """A rule for one JSON value the schema accepts, with at most one whitespace character
        between its tokens; no string in it (keys included) holds any of ``excludes``."""
        return self.schema_value(schema, "json", excludes=excludes)

    def schema_value(
        self,
        schema: Mapping[str, Any],
        style: str,
        *,
        excludes: Sequence[str] = (),
        whitespace: bool = True,
    ) -> str:
        """A rule for one value the JSON schema accepts, written in one of xgrammar's styles
        (``json``, ``gemma``); without ``whitespace``, none between its tokens."""
        spec = {
            "type": "json_schema",
            "json_schema": schema,
            "style": style,
            "max_whitespace_cnt": 1,  # the least xgrammar takes
            "excludes": list(excludes),
        }
        key = json.dumps([spec, whitespace])  # not sorted: values follow the property order
        if key not in self._roots:
            import xgrammar

            tag = xgrammar.Grammar.from_structural_tag(
                json.dumps({"type": "structural_tag", "format": spec})
            )
            self._roots[key] = self.embed(str(tag), drop_whitespace=not whitespace)
        return self._roots[key]

    def embed(self, ebnf: str, *, drop_whitespace: bool = False) -> str:
        """Add the rules of a grammar xgrammar wrote out; returns the name of its root.

        ``drop_whitespace``: rules of one optional whitespace character match nothing instead.
        """
        if ebnf in self._roots:
            return self._roots[ebnf]
        rules = _split_rules(ebnf)
        if drop_whitespace:
            rules = {n: '""' if b == _OPTIONAL_WHITESPACE else b for n, b in rules.items()}
        shared = {n: b for n, b in rules.items() if n.startswith(_SHARED_PREFIX)}
        shareable = all(
            self._rules.get(name, body) == body and _references(body, rules) <= shared.keys()
            for name, body in shared.items()
        )
        prefix = f"g{next(self._ids)}_"
        renames = {n: n if shareable and n in shared else prefix + n for n in rules}
        for name, body in rules.items():
            self._rules[renames[name]] = _rename(body, renames)
        self._roots[ebnf] = renames["root"]
        return renames["root"]

    def build(self, root_body: str) -> str:
        return "\n".join(
            [f"root ::= {root_body}", *(f"{n} ::= {b}" for n, b in self._rules.items())]
        )


def ordered_members(grammar: GrammarBuilder, members: Sequence[tuple[str, bool]]) -> str:
    """Members in their order, each (EBNF body, whether required); optional ones may be left out.

    Each optional member makes a rule of the rest, so the grammar grows linearly.
    """
    rest = '""'
    for body, required in reversed(members):
        if required:
            rest = f"{body} {rest}"
        else:
            rest = grammar.rule("members", f"({body} {rest}) | ({rest})")
    return rest


def one_call_of(tools: Sequence[ToolSpec], spell: Callable[[ToolSpec], str]) -> str:
    """The alternatives of a call to each tool; ``spell`` writes one tool's call."""
    return "(" + " | ".join(f"({spell(tool)})" for tool in tools) + ")"


def repeat_calls(
    grammar: GrammarBuilder, call: str, *, several: bool, separator: str = '""'
) -> str:
    """``call`` (the EBNF of one call, in its frame) once; with ``several``, one or more times
    with ``separator`` (EBNF) between each and the next."""
    item = grammar.rule("call", call)
    if not several:
        return item
    return grammar.rule("calls", f"{item} ({separator} {item})*")


def checked_name(tool: ToolSpec) -> str:
    """The function name, for formats that write it bare between delimiters."""
    if not is_valid_name(tool.name):
        raise ValueError(
            f"function name {tool.name!r} cannot be written in this tool-call format: name "
            f"functions without spaces, quotes, brackets or any of <>=,;"
        )
    return tool.name


def arguments_schema(tool: ToolSpec) -> dict[str, Any]:
    """The schema of a call's arguments: an object, whatever else the tool's schema says."""
    schema = dict(tool.schema)
    if "type" not in schema:
        schema["type"] = "object"
    return schema


def _split_rules(ebnf: str) -> dict[str, str]:
    starts = list(_RULE_START.finditer(ebnf))
    return {
        match.group(1): ebnf[match.end() : following.start() if following else len(ebnf)].strip()
        for match, following in zip(starts, [*starts[1:], None], strict=True)
    }


def _references(body: str, rules: Mapping[str, str]) -> set[str]:
    return {token for token in _BODY_TOKEN.findall(body) if token in rules}


def _rename(body: str, renames: Mapping[str, str]) -> str:
    return _BODY_TOKEN.sub(lambda m: renames.get(m.group(0), m.group(0)), body)
