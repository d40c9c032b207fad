"""Tool-call format name -> parser class. A new format registers itself here.

``auto`` is not a format: it names the one that `detect_tool_parser` reads off the chat
template, resolved once when the parser is made.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

from metrale.frontend.tool_parsers.base import ToolParser, ToolParserOptions
from metrale.frontend.tool_parsers.schema import ToolSpec

AUTO = "auto"

ParserT = TypeVar("ParserT", bound=type[ToolParser])

_REGISTRY: dict[str, type[ToolParser]] = {}

# (what the chat template contains, the format): the first rule whose markers all occur wins,
# so the more specific rules come first.
_TEMPLATE_RULES: tuple[tuple[tuple[str, ...], str], ...] = (
    (("minimax:tool_call",), "minimax_xml"),
    (("<|tool_call>",), "gemma4"),
    (("[TOOL_CALLS]",), "mistral"),
    (("<tool_call>", "<function="), "qwen3_coder"),
    (("<tool_call>", "<arg_key>"), "poolside_v1"),
    (("<tool_call>",), "hermes"),
)


def register_tool_parser(name: str) -> Callable[[ParserT], ParserT]:
    def decorate(factory: ParserT) -> ParserT:
        if name == AUTO or name in _REGISTRY:
            raise ValueError(f"tool parser name {name!r} is already taken")
        _REGISTRY[name] = factory
        return factory

    return decorate


def tool_parser_names() -> list[str]:
    return [*sorted(_REGISTRY), AUTO]


def detect_tool_parser(chat_template: str) -> str | None:
    """The tool-call format a chat template teaches, from the markers it writes; None if none."""
    for markers, name in _TEMPLATE_RULES:
        if all(marker in chat_template for marker in markers):
            return name
    return None


def tool_parser_class(name: str, *, chat_template: str | None = None) -> type[ToolParser]:
    """The parser class of a format, which also describes it (markers, call end, grammar).

    ``auto`` needs the model's ``chat_template``.
    """
    if name == AUTO:
        detected = detect_tool_parser(chat_template or "")
        if detected is None:
            raise ValueError(
                "tool parser 'auto' found no tool-call markers in the chat template; "
                f"name the format instead (one of {', '.join(sorted(_REGISTRY))})"
            )
        name = detected
    parser_class = _REGISTRY.get(name)
    if parser_class is None:
        raise ValueError(f"unknown tool parser {name!r}; known: {', '.join(tool_parser_names())}")
    return parser_class


def make_tool_parser(
    name: str,
    *,
    tools: Iterable[ToolSpec] = (),
    id_prefix: str = "call_",
    chat_template: str | None = None,
) -> ToolParser:
    """A fresh parser for one generation. ``auto`` needs the model's ``chat_template``."""
    parser_class = tool_parser_class(name, chat_template=chat_template)
    return parser_class(ToolParserOptions({tool.name: tool for tool in tools}, id_prefix))
