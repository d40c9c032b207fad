"""Model outputs for each tool-call format, with the content and calls they must parse to.

A fixture is (name, output text, expected content, expected calls as (name, arguments JSON));
call ids are ``call_<index>``. Adding a case is adding a line. Every fixture is run through
every splitting in tests/frontend/splits.py.
"""

from __future__ import annotations

from metrale.frontend.tool_parsers import tool_specs

Fixture = tuple[str, str, str, list[tuple[str, str]]]

TOOLS = tool_specs(
    [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "city": {"type": "string"},
                        "days": {"type": "integer"},
                        "metric": {"type": "boolean"},
                        "ratio": {"type": "number"},
                        "opts": {"type": "object"},
                        "tags": {"type": "array", "items": {"type": "string"}},
                        "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                    },
                },
            },
        },
        {
            "type": "function",
            "function": {
                "name": "write_file",
                "parameters": {
                    "type": "object",
                    "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                },
            },
        },
        {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
    ]
)

PARIS = ("get_weather", '{"city": "Paris"}')
GET_TIME = ("get_time", "{}")

# --- hermes: JSON in <tool_call> ---------------------------------------------------------

HERMES_PARIS = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'

HERMES: list[Fixture] = [
    ("plain_text", "Just an answer, no tools.", "Just an answer, no tools.", []),
    ("single_call", HERMES_PARIS, "", [PARIS]),
    (
        "text_before_and_between",
        f"Let me check.\n{HERMES_PARIS}\nAnd Oslo:\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
        "Let me check.\n\nAnd Oslo:\n",
        [PARIS, ("get_weather", '{"city": "Oslo"}')],
    ),
    (
        "parallel_calls",
        f'{HERMES_PARIS}\n<tool_call>\n{{"name": "get_time", "arguments": {{}}}}\n</tool_call>\n',
        "",
        [PARIS, GET_TIME],
    ),
    (
        "closing_tag_inside_string",
        '<tool_call>\n{"name": "write_file", "arguments": {"path": "a.md", '
        '"content": "<tool_call>x</tool_call>"}}\n</tool_call>',
        "",
        [("write_file", '{"path": "a.md", "content": "<tool_call>x</tool_call>"}')],
    ),
    (
        "empty_arguments",
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
        "",
        [GET_TIME],
    ),
    ("no_arguments_member", '<tool_call>\n{"name": "get_time"}\n</tool_call>', "", [GET_TIME]),
    (
        "arguments_before_name",
        '<tool_call>{"arguments": {"city": "Paris"}, "name": "get_weather"}</tool_call>',
        "",
        [PARIS],
    ),
    (
        "parameters_member",
        '<tool_call>{"name": "get_weather", "parameters": {"city": "Paris"}}</tool_call>',
        "",
        [PARIS],
    ),
    (
        "truncated_in_string",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
        "",
        [("get_weather", '{"city": "Par"}')],
    ),
    (
        "truncated_in_key",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "da',
        "",
        [PARIS],
    ),
    (
        "truncated_in_number",
        '<tool_call>{"name": "get_weather", "arguments": {"days": 12',
        "",
        [("get_weather", '{"days": 12}')],
    ),
    (
        "truncated_in_name",
        'Hold on <tool_call>\n{"name": "get_wea',
        'Hold on <tool_call>\n{"name": "get_wea',
        [],
    ),
    (
        "garbage_inside_tags",
        "Hmm <tool_call>not json at all</tool_call> done",
        "Hmm <tool_call>not json at all</tool_call> done",
        [],
    ),
    (
        "json_without_name",
        '<tool_call>{"city": "Paris"}</tool_call>',
        '<tool_call>{"city": "Paris"}</tool_call>',
        [],
    ),
    (
        "unicode_arguments",
        '<tool_call>{"name": "get_weather", "arguments": {"city": "東京", '
        '"note": "café ☕ \\u00e9"}}</tool_call>',
        "",
        [("get_weather", '{"city": "東京", "note": "café ☕ \\u00e9"}')],
    ),
    (
        "raw_newline_and_bad_escape_in_string",
        '<tool_call>{"name": "write_file", "arguments": {"path": "C:\\Users", '
        '"content": "a\nb"}}</tool_call>',
        "",
        [("write_file", '{"path": "C:\\\\Users", "content": "a\\nb"}')],
    ),
    (
        "missing_closing_brace",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>',
        "",
        [PARIS],
    ),
    (
        "junk_after_arguments",
        '<tool_call>{"name": "get_time", "arguments": {} oops}</tool_call>',
        "oops}</tool_call>",
        [GET_TIME],
    ),
    (
        "string_encoded_arguments",
        '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}</tool_call>',
        "",
        [PARIS],
    ),
    ("partial_opener_at_end", "See <tool_c", "See <tool_c", []),
    (
        "nested_arguments",
        '<tool_call>{"name": "get_weather", "arguments": {"opts": {"a": [1, 2.5e3, null, true]}, '
        '"tags": []}}</tool_call>',
        "",
        [("get_weather", '{"opts": {"a": [1, 2.5e3, null, true]}, "tags": []}')],
    ),
    (
        "missing_closing_tag_then_text",
        '<tool_call>{"name": "get_time", "arguments": {}}\nThat is all.',
        "\nThat is all.",
        [GET_TIME],
    ),
]

# --- qwen3_coder and qwen3_xml: <function=...><parameter=...> -------------------------------


def qwen_call(name: str, *params: tuple[str, str]) -> str:
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


QWEN_PARIS = qwen_call("get_weather", ("city", "Paris"))

QWEN3_COMMON: list[Fixture] = [
    ("plain_text", "No tools needed: 2 + 2 = 4.", "No tools needed: 2 + 2 = 4.", []),
    ("single_call", QWEN_PARIS, "", [PARIS]),
    (
        "typed_scalars",
        qwen_call(
            "get_weather",
            ("city", "Paris"),
            ("days", "3"),
            ("metric", "True"),
            ("ratio", "0.5"),
        ),
        "",
        [("get_weather", '{"city": "Paris", "days": 3, "metric": true, "ratio": 0.5}')],
    ),
    (
        "typed_containers",
        qwen_call("get_weather", ("opts", '{"a": [1, 2]}'), ("tags", '["x", "y"]')),
        "",
        [("get_weather", '{"opts": {"a": [1, 2]}, "tags": ["x", "y"]}')],
    ),
    (
        "python_literal_object",
        qwen_call("get_weather", ("opts", "{'deep': True, 'n': None}")),
        "",
        [("get_weather", '{"opts": {"deep": true, "n": null}}')],
    ),
    (
        "type_mismatch_stays_string",
        qwen_call("get_weather", ("days", "three"), ("metric", "maybe")),
        "",
        [("get_weather", '{"days": "three", "metric": "maybe"}')],
    ),
    (
        "nullable_and_untyped",
        qwen_call("get_weather", ("note", "null"), ("extra", "42")),
        "",
        [("get_weather", '{"note": null, "extra": "42"}')],
    ),
    (
        "unknown_tool_values_stay_strings",
        qwen_call("lookup", ("n", "5"), ("flag", "true")),
        "",
        [("lookup", '{"n": "5", "flag": "true"}')],
    ),
    (
        "text_before_and_between",
        f"Checking.\n\n{QWEN_PARIS}\nNow the time.\n{qwen_call('get_time')}",
        "Checking.\n\n\nNow the time.\n",
        [PARIS, GET_TIME],
    ),
    ("parallel_calls", f"{QWEN_PARIS}\n{qwen_call('get_time')}", "", [PARIS, GET_TIME]),
    ("no_parameters", qwen_call("get_time"), "", [GET_TIME]),
    (
        "missing_parameter_close",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
        "<parameter=days>\n3\n</function>\n</tool_call>",
        "",
        [("get_weather", '{"city": "Paris", "days": 3}')],
    ),
    (
        "missing_function_close",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</tool_call>",
        "",
        [PARIS],
    ),
    (
        "truncated_in_value",
        "<tool_call>\n<function=write_file>\n<parameter=content>\nprint(1)\npri",
        "",
        [("write_file", '{"content": "print(1)\\npri"}')],
    ),
    (
        "truncated_in_name",
        "Sure.\n<tool_call>\n<function=get_wea",
        "Sure.\n<tool_call>\n<function=get_wea",
        [],
    ),
    (
        "garbage_inside_tags",
        "<tool_call>\nsorry, I cannot\n</tool_call>",
        "<tool_call>\nsorry, I cannot\n</tool_call>",
        [],
    ),
    (
        "unicode_values",
        qwen_call("get_weather", ("city", "São Paulo 🌧"), ("note", 'naïve «quotes» "q"')),
        "",
        [("get_weather", '{"city": "São Paulo 🌧", "note": "naïve «quotes» \\"q\\""}')],
    ),
    (
        "code_value_keeps_layout",
        qwen_call("write_file", ("content", "def f():\n\n    return {'a': 1}\n")),
        "",
        [("write_file", '{"content": "def f():\\n\\n    return {\'a\': 1}\\n"}')],
    ),
    (
        "empty_value",
        "<tool_call>\n<function=write_file>\n<parameter=content>\n</parameter>\n</function>\n"
        "</tool_call>",
        "",
        [("write_file", '{"content": ""}')],
    ),
    (
        "stopped_at_call_end",
        QWEN_PARIS.removesuffix("\n</tool_call>"),
        "",
        [PARIS],
    ),
]

LITERAL_TAG_CALL = qwen_call("write_file", ("content", 'x = "</parameter>"\ny'))

QWEN3_CODER: list[Fixture] = [
    *QWEN3_COMMON,
    (
        "literal_close_tag_cuts_value",
        LITERAL_TAG_CALL,
        '"\ny\n</parameter>\n</function>\n</tool_call>',
        [("write_file", '{"content": "x = \\""}')],
    ),
]

QWEN3_XML: list[Fixture] = [
    *QWEN3_COMMON,
    (
        "literal_close_tag_kept",
        LITERAL_TAG_CALL,
        "",
        [("write_file", '{"content": "x = \\"</parameter>\\"\\ny"}')],
    ),
    (
        "literal_tags_documenting_the_format",
        qwen_call("write_file", ("content", "use <parameter=x> then </function> inline")),
        "",
        [("write_file", '{"content": "use <parameter=x> then </function> inline"}')],
    ),
]

# --- gemma4: <|tool_call>call:NAME{key:<|"|>v<|"|>}<tool_call|> ---------------------------

Q = '<|"|>'
GEMMA_PARIS = f"<|tool_call>call:get_weather{{city:{Q}Paris{Q}}}<tool_call|>"

GEMMA4: list[Fixture] = [
    ("plain_text", "Gemma says hi.", "Gemma says hi.", []),
    ("single_call", GEMMA_PARIS, "", [PARIS]),
    (
        "scalars",
        f"<|tool_call>call:get_weather{{city:{Q}Paris{Q},days:3,metric:true,ratio:-0.5}}"
        "<tool_call|>",
        "",
        [("get_weather", '{"city": "Paris", "days": 3, "metric": true, "ratio": -0.5}')],
    ),
    (
        "nested_values",
        f"<|tool_call>call:get_weather{{opts:{{a:1,b:[{Q}x{Q},true,None]}},tags:[]}}<tool_call|>",
        "",
        [("get_weather", '{"opts": {"a": 1, "b": ["x", true, null]}, "tags": []}')],
    ),
    (
        "text_before_and_after",
        f"Let me look.{GEMMA_PARIS}Done.",
        "Let me look.Done.",
        [PARIS],
    ),
    (
        "back_to_back_calls",
        f"{GEMMA_PARIS}<|tool_call>call:get_time{{}}<tool_call|>",
        "",
        [PARIS, GET_TIME],
    ),
    ("empty_arguments", "<|tool_call>call:get_time{}<tool_call|>", "", [GET_TIME]),
    (
        "braces_and_quotes_in_string",
        f'<|tool_call>call:write_file{{content:{Q}if (x) {{ say("hi"); }}{Q}}}<tool_call|>',
        "",
        [("write_file", '{"content": "if (x) { say(\\"hi\\"); }"}')],
    ),
    (
        "bare_word_value",
        "<|tool_call>call:get_weather{city:Paris,note:None}<tool_call|>",
        "",
        [("get_weather", '{"city": "Paris", "note": null}')],
    ),
    (
        "truncated_in_string",
        f"<|tool_call>call:write_file{{content:{Q}hello wor",
        "",
        [("write_file", '{"content": "hello wor"}')],
    ),
    (
        "truncated_after_key",
        f"<|tool_call>call:get_weather{{city:{Q}Paris{Q},days:",
        "",
        [PARIS],
    ),
    (
        "truncated_in_bare_value",
        "<|tool_call>call:get_weather{days:1",
        "",
        [("get_weather", '{"days": 1}')],
    ),
    ("truncated_in_name", "<|tool_call>call:get_wea", "<|tool_call>call:get_wea", []),
    (
        "garbage_inside_tags",
        "<|tool_call>I cannot call tools<tool_call|>",
        "<|tool_call>I cannot call tools<tool_call|>",
        [],
    ),
    (
        "missing_close_tag",
        "<|tool_call>call:get_time{} All set.",
        " All set.",
        [GET_TIME],
    ),
    (
        "missing_closing_brace",
        "<|tool_call>call:get_weather{days:1<tool_call|>",
        "",
        [("get_weather", '{"days": 1}')],
    ),
    (
        "trailing_comma",
        "<|tool_call>call:get_weather{days:1,\n}<tool_call|>",
        "",
        [("get_weather", '{"days": 1}')],
    ),
    (
        "unicode_values",
        f"<|tool_call>call:get_weather{{city:{Q}Zürich 🏔{Q},note:{Q}東京\n{Q}}}<tool_call|>",
        "",
        [("get_weather", '{"city": "Zürich 🏔", "note": "東京\\n"}')],
    ),
    (
        "broken_key",
        "<|tool_call>call:get_weather{city{x}}<tool_call|>",
        "{x}}<tool_call|>",
        [("get_weather", "{}")],
    ),
]

# --- mistral: [TOOL_CALLS] ------------------------------------------------------------------

MISTRAL: list[Fixture] = [
    ("plain_text", "Bonjour.", "Bonjour.", []),
    (
        "array_single",
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]',
        "",
        [PARIS],
    ),
    (
        "array_parallel_with_text_before",
        'Sure.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_time", "arguments": {}}]',
        "Sure.",
        [PARIS, GET_TIME],
    ),
    (
        "array_parallel",
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_time", "arguments": {}}]',
        "",
        [PARIS, GET_TIME],
    ),
    ("v11_single", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', "", [PARIS]),
    (
        "v11_parallel",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}',
        "",
        [PARIS, GET_TIME],
    ),
    (
        "v11_call_id",
        '[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Paris"}',
        "",
        [PARIS],
    ),
    ("v11_without_args_tag", '[TOOL_CALLS]get_weather{"city": "Paris"}', "", [PARIS]),
    ("v11_empty_arguments", "[TOOL_CALLS]get_time[ARGS]{}", "", [GET_TIME]),
    (
        "empty_and_missing_arguments",
        '[TOOL_CALLS][{"name": "get_time", "arguments": {}}, {"name": "get_date"}]',
        "",
        [GET_TIME, ("get_date", "{}")],
    ),
    (
        "opener_inside_string",
        '[TOOL_CALLS]write_file[ARGS]{"content": "use [TOOL_CALLS] and ]}"}',
        "",
        [("write_file", '{"content": "use [TOOL_CALLS] and ]}"}')],
    ),
    (
        "truncated_array",
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Par',
        "",
        [("get_weather", '{"city": "Par"}')],
    ),
    (
        "truncated_v11",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3',
        "",
        [("get_weather", '{"city": "Paris", "days": 3}')],
    ),
    ("truncated_in_name", "[TOOL_CALLS]get_wea", "[TOOL_CALLS]get_wea", []),
    ("garbage_after_opener", "[TOOL_CALLS] sorry!", "[TOOL_CALLS] sorry!", []),
    (
        "array_without_calls",
        '[TOOL_CALLS] [{"foo": 1}]',
        '[TOOL_CALLS] [{"foo": 1}]',
        [],
    ),
    (
        "non_call_element_skipped",
        '[TOOL_CALLS] [{"foo": 1}, {"name": "get_time", "arguments": {}}]',
        "",
        [GET_TIME],
    ),
    (
        "unicode_arguments",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Kraków", "note": "😀 \\ud83d\\ude00"}',
        "",
        [("get_weather", '{"city": "Kraków", "note": "😀 \\ud83d\\ude00"}')],
    ),
    (
        "single_object_without_array",
        '[TOOL_CALLS] {"name": "get_time", "arguments": {}}',
        "",
        [GET_TIME],
    ),
    ("text_after_v11_call", "[TOOL_CALLS]get_time[ARGS]{} Done.", " Done.", [GET_TIME]),
    (
        "array_not_closed",
        '[TOOL_CALLS] [{"name": "get_time", "arguments": {}}',
        "",
        [GET_TIME],
    ),
]

# --- minimax_xml: <minimax:tool_call><invoke name=...> -------------------------------------


def invoke(name: str, *params: tuple[str, str]) -> str:
    body = "".join(f'<parameter name="{key}">{value}</parameter>\n' for key, value in params)
    return f'<invoke name="{name}">\n{body}</invoke>\n'


def minimax_block(*invokes: str) -> str:
    return "<minimax:tool_call>\n" + "".join(invokes) + "</minimax:tool_call>"


MINIMAX_PARIS = minimax_block(invoke("get_weather", ("city", "Paris")))

MINIMAX_XML: list[Fixture] = [
    ("plain_text", "MiniMax answers directly.", "MiniMax answers directly.", []),
    ("single_invoke", MINIMAX_PARIS, "", [PARIS]),
    (
        "two_invokes_one_block",
        minimax_block(invoke("get_weather", ("city", "Paris")), invoke("get_time")),
        "",
        [PARIS, GET_TIME],
    ),
    (
        "two_blocks_with_text",
        f"First:\n{MINIMAX_PARIS}\nthen:\n{minimax_block(invoke('get_time'))}",
        "First:\n\nthen:\n",
        [PARIS, GET_TIME],
    ),
    (
        "typed_values",
        minimax_block(
            invoke("get_weather", ("days", "3"), ("metric", "false"), ("tags", '["a", "b"]'))
        ),
        "",
        [("get_weather", '{"days": 3, "metric": false, "tags": ["a", "b"]}')],
    ),
    (
        "quoted_and_bare_names",
        "<minimax:tool_call>\n<invoke name=get_weather>\n<parameter name='city'>Paris</parameter>\n"
        "</invoke>\n</minimax:tool_call>",
        "",
        [PARIS],
    ),
    ("no_parameters", minimax_block(invoke("get_time")), "", [GET_TIME]),
    (
        "missing_parameter_close",
        '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris\n'
        '<parameter name="days">3</parameter>\n</invoke>\n</minimax:tool_call>',
        "",
        [("get_weather", '{"city": "Paris", "days": 3}')],
    ),
    (
        "missing_invoke_close",
        '<minimax:tool_call>\n<invoke name="get_weather">\n'
        '<parameter name="city">Paris</parameter>\n</minimax:tool_call>',
        "",
        [PARIS],
    ),
    (
        "truncated_in_value",
        '<minimax:tool_call>\n<invoke name="write_file">\n<parameter name="content">abc',
        "",
        [("write_file", '{"content": "abc"}')],
    ),
    (
        "truncated_in_invoke_name",
        'Ok <minimax:tool_call>\n<invoke name="get_we',
        'Ok <minimax:tool_call>\n<invoke name="get_we',
        [],
    ),
    (
        "garbage_inside_tags",
        "<minimax:tool_call>oops</minimax:tool_call>",
        "<minimax:tool_call>oops</minimax:tool_call>",
        [],
    ),
    (
        "unicode_values",
        minimax_block(invoke("get_weather", ("city", "Αθήνα"), ("note", "ünïcödé ✓"))),
        "",
        [("get_weather", '{"city": "Αθήνα", "note": "ünïcödé ✓"}')],
    ),
    (
        "code_value_newlines",
        minimax_block(invoke("write_file", ("content", "\ndef f():\n    return 1\n"))),
        "",
        [("write_file", '{"content": "def f():\\n    return 1"}')],
    ),
    (
        "unknown_tool_values_stay_strings",
        minimax_block(invoke("lookup", ("n", "5"))),
        "",
        [("lookup", '{"n": "5"}')],
    ),
    (
        "stopped_at_call_end",
        MINIMAX_PARIS.removesuffix("\n</minimax:tool_call>"),
        "",
        [PARIS],
    ),
    (
        "junk_between_parameters",
        '<minimax:tool_call>\n<invoke name="get_weather">\n'
        '<parameter name="city">Paris</parameter>\nhmm</invoke>\n</minimax:tool_call>',
        "hmm</invoke>\n</minimax:tool_call>",
        [PARIS],
    ),
]

# --- poolside_v1: <tool_call>NAME<arg_key>k</arg_key><arg_value>v</arg_value> ---------------


def poolside_call(name: str, *args: tuple[str, str]) -> str:
    body = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in args)
    return f"<tool_call>{name}\n{body}</tool_call>"


POOLSIDE_PARIS = poolside_call("get_weather", ("city", "Paris"))

POOLSIDE_V1: list[Fixture] = [
    ("plain_text", "Laguna reply.", "Laguna reply.", []),
    ("single_call", POOLSIDE_PARIS, "", [PARIS]),
    (
        "inline_name_typed",
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
        "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>",
        "",
        [("get_weather", '{"city": "Paris", "days": 3}')],
    ),
    (
        "string_whitespace_kept",
        poolside_call("write_file", ("content", "\n    indented\n")),
        "",
        [("write_file", '{"content": "\\n    indented\\n"}')],
    ),
    (
        "typed_string_not_parsed",
        poolside_call("get_weather", ("city", "123")),
        "",
        [("get_weather", '{"city": "123"}')],
    ),
    (
        "untyped_values_parsed",
        poolside_call("lookup", ("n", "5"), ("flag", "true"), ("items", "[1, 2]"), ("w", "hi")),
        "",
        [("lookup", '{"n": 5, "flag": true, "items": [1, 2], "w": "hi"}')],
    ),
    (
        "python_literal",
        poolside_call("lookup", ("opts", "{'a': True}")),
        "",
        [("lookup", '{"opts": {"a": true}}')],
    ),
    (
        "text_before_and_between",
        f"Let me see.\n{POOLSIDE_PARIS}\nand\n{poolside_call('get_time')}",
        "Let me see.\n\nand\n",
        [PARIS, GET_TIME],
    ),
    ("parallel_calls", f"{POOLSIDE_PARIS}\n{poolside_call('get_time')}", "", [PARIS, GET_TIME]),
    ("no_arguments", "<tool_call>get_time</tool_call>", "", [GET_TIME]),
    (
        "missing_value_close",
        "<tool_call>get_weather\n<arg_key>city</arg_key><arg_value>Paris<arg_key>days</arg_key>"
        "<arg_value>3</arg_value></tool_call>",
        "",
        [("get_weather", '{"city": "Paris", "days": 3}')],
    ),
    (
        "truncated_in_value",
        "<tool_call>write_file\n<arg_key>content</arg_key>\n<arg_value>hel",
        "",
        [("write_file", '{"content": "hel"}')],
    ),
    ("truncated_in_name", "<tool_call>get_wea", "<tool_call>get_wea", []),
    (
        "json_inside_tags_is_not_this_format",
        '<tool_call>{"name": "get_time"}</tool_call>',
        '<tool_call>{"name": "get_time"}</tool_call>',
        [],
    ),
    (
        "unicode_values",
        poolside_call("get_weather", ("city", "Ürümqi"), ("note", "中文 ✓")),
        "",
        [("get_weather", '{"city": "Ürümqi", "note": "中文 ✓"}')],
    ),
    (
        "key_without_value",
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n</tool_call>",
        "",
        [("get_weather", "{}")],
    ),
]

# --- bare_json: the whole output is a call ---------------------------------------------------

BARE_JSON: list[Fixture] = [
    ("plain_text", "Plain prose answer.", "Plain prose answer.", []),
    ("object_call", '{"name": "get_weather", "arguments": {"city": "Paris"}}', "", [PARIS]),
    (
        "llama_parameters",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        "",
        [PARIS],
    ),
    (
        "surrounding_whitespace",
        '\n  {"name": "get_weather", "arguments": {"city": "Paris"}}\n\n',
        "",
        [PARIS],
    ),
    (
        "array_of_calls",
        '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time"}]',
        "",
        [PARIS, GET_TIME],
    ),
    (
        "array_of_full_calls",
        '[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_time", "parameters": {}}]',
        "",
        [PARIS, GET_TIME],
    ),
    ("json_not_a_call", '{"answer": 42}', '{"answer": 42}', []),
    (
        "json_with_a_name_that_is_no_tool",
        '{"name": "Ada", "born": 1815}',
        '{"name": "Ada", "born": 1815}',
        [],
    ),
    (
        "prose_first",
        'The call is {"name": "get_time"}',
        'The call is {"name": "get_time"}',
        [],
    ),
    ("text_after_call", '{"name": "get_time", "arguments": {}} done', " done", [GET_TIME]),
    (
        "truncated_in_arguments",
        '{"name": "get_weather", "arguments": {"city": "Par',
        "",
        [("get_weather", '{"city": "Par"}')],
    ),
    ("truncated_in_name", '{"name": "get_w', '{"name": "get_w', []),
    ("empty_arguments", '{"name": "get_time", "arguments": {}}', "", [GET_TIME]),
    ("no_arguments", '{"name": "get_time"}', "", [GET_TIME]),
    (
        "unicode_arguments",
        '{"name": "get_weather", "arguments": {"city": "Reykjavík ❄"}}',
        "",
        [("get_weather", '{"city": "Reykjavík ❄"}')],
    ),
    (
        "closing_tag_inside_string",
        '{"name": "write_file", "arguments": {"content": "</tool_call>"}}',
        "",
        [("write_file", '{"content": "</tool_call>"}')],
    ),
    ("broken_after_name", '{"name": "get_time", oops}', "oops}", [GET_TIME]),
    (
        "array_with_non_call",
        '[{"x": 1}, {"name": "get_time"}]',
        "",
        [GET_TIME],
    ),
]

FIXTURES: dict[str, list[Fixture]] = {
    "hermes": HERMES,
    "qwen3_coder": QWEN3_CODER,
    "qwen3_xml": QWEN3_XML,
    "gemma4": GEMMA4,
    "mistral": MISTRAL,
    "minimax_xml": MINIMAX_XML,
    "poolside_v1": POOLSIDE_V1,
    "bare_json": BARE_JSON,
}
