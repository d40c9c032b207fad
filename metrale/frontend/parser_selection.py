"""Which tool-call and reasoning parsers a served model gets.

The flag wins (`--tool-call-parser`, `--reasoning-parser`); then `tool_defaults.toml`, keyed by
the checkpoint's `model_type`; then, for tool calls, the format the chat template reveals.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from importlib import resources

from metrale.frontend.reasoning import reasoning_parser_names
from metrale.frontend.tool_parsers import detect_tool_parser, tool_parser_names

NONE = "none"


@dataclass(frozen=True)
class ParserChoice:
    tool_call_parser: str | None
    reasoning_parser: str | None


def model_type_defaults(model_type: str) -> dict[str, str]:
    text = (resources.files("metrale.frontend") / "tool_defaults.toml").read_text()
    return tomllib.loads(text).get(model_type, {})


def choose_parsers(
    tool_flag: str | None, reasoning_flag: str | None, model_type: str, chat_template: str
) -> ParserChoice:
    defaults = model_type_defaults(model_type)
    tool = tool_flag or defaults.get("tool_call_parser") or "auto"
    if tool == "auto":
        tool = detect_tool_parser(chat_template) or NONE
    if tool != NONE and tool not in tool_parser_names():
        raise ValueError(
            f"--tool-call-parser {tool!r}: known formats are "
            f"{', '.join(tool_parser_names())}, auto or none"
        )
    reasoning = reasoning_flag or defaults.get("reasoning_parser") or NONE
    if reasoning != NONE and reasoning not in reasoning_parser_names():
        raise ValueError(
            f"--reasoning-parser {reasoning!r}: known formats are "
            f"{', '.join(reasoning_parser_names())} or none"
        )
    return ParserChoice(None if tool == NONE else tool, None if reasoning == NONE else reasoning)
