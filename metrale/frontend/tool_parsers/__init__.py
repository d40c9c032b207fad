"""Tool-call parsers: model output text -> content and OpenAI tool calls, streaming or not.

    parser = make_tool_parser("hermes", tools=tool_specs(request.tools), id_prefix="call_ab_")
    for delta in text_deltas:
        events = parser.feed(delta)   # ContentDelta / ToolCallStart / ToolCallArguments
    events = parser.finish()
    parser.outcomes               # {"parsed": n, "repaired": n, "text": n}, for metrics

Formats register by name in `registry`; importing this package registers them all. A format's
class also says what a request needs of it: `tool_parser_class(name).call_grammar(tools)` is
the grammar that forces one call (``several=True``: one or more), ``markers`` the strings
detokenization must keep, and ``call_end`` where a reply with one call may stop.
"""

from metrale.frontend.tool_parsers import bare_json as _bare_json  # noqa: F401  (registers)
from metrale.frontend.tool_parsers import gemma4 as _gemma4  # noqa: F401  (registers)
from metrale.frontend.tool_parsers import hermes as _hermes  # noqa: F401  (registers)
from metrale.frontend.tool_parsers import minimax_xml as _minimax_xml  # noqa: F401  (registers)
from metrale.frontend.tool_parsers import mistral as _mistral  # noqa: F401  (registers)
from metrale.frontend.tool_parsers import poolside_v1 as _poolside_v1  # noqa: F401  (registers)
from metrale.frontend.tool_parsers import qwen3_xml as _qwen3_xml  # noqa: F401  (registers)
from metrale.frontend.tool_parsers.base import (
    CallOutcome,
    ContentDelta,
    Event,
    ToolCall,
    ToolCallArguments,
    ToolCallStart,
    ToolParser,
    ToolParserOptions,
    collect,
    count_outcomes,
)
from metrale.frontend.tool_parsers.registry import (
    detect_tool_parser,
    make_tool_parser,
    register_tool_parser,
    tool_parser_class,
    tool_parser_names,
)
from metrale.frontend.tool_parsers.schema import ParamSchema, ToolSpec, tool_specs

__all__ = [
    "CallOutcome",
    "ContentDelta",
    "Event",
    "ParamSchema",
    "ToolCall",
    "ToolCallArguments",
    "ToolCallStart",
    "ToolParser",
    "ToolParserOptions",
    "ToolSpec",
    "collect",
    "count_outcomes",
    "detect_tool_parser",
    "make_tool_parser",
    "register_tool_parser",
    "tool_parser_class",
    "tool_parser_names",
    "tool_specs",
]
