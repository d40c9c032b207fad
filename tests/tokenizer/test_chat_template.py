"""Chat template rendering against transformers, resolution order, errors and the sandbox."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest

import metrale.tokenizer
import metrale.tokenizer.chat_template as chat_template_module
from metrale.tokenizer import ChatTemplate, ChatTemplateError, Tokenizer, resolve_chat_template

transformers = pytest.importorskip("transformers")
from transformers.utils.chat_template_utils import render_jinja_template  # noqa: E402

DEMO_DIR = Path(metrale.tokenizer.__file__).resolve().parent.parent / "demo" / "tokenizer"

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name, e.g. Zürich"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "The time now.", "parameters": {}},
    },
]

USER = {"role": "user", "content": "What's the weather in Zürich? 🌦"}
SYSTEM = {"role": "system", "content": "You are terse."}
WEATHER_CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Zürich", "unit": "celsius"}},
}
TIME_CALL_STRING_ARGS = {
    "id": "call_2",
    "type": "function",
    "function": {"name": "get_time", "arguments": "{}"},
}

CONVERSATIONS = {
    "plain": [USER],
    "system": [SYSTEM, USER],
    "multi_turn": [
        SYSTEM,
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ],
    "content_parts": [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Part one. "}, {"type": "text", "text": "Two."}],
        }
    ],
    "tool_round_trip": [
        SYSTEM,
        USER,
        {"role": "assistant", "content": None, "tool_calls": [WEATHER_CALL, TIME_CALL_STRING_ARGS]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 7}'},
        {"role": "tool", "tool_call_id": "call_2", "content": "10:42"},
    ],
    "tool_call_with_text_then_answer": [
        USER,
        {"role": "assistant", "content": "Let me check.", "tool_calls": [WEATHER_CALL]},
        {"role": "tool", "content": "7°C, rain"},
        {"role": "assistant", "content": "7°C and rainy."},
        {"role": "user", "content": "Thanks!"},
    ],
    "reasoning_history": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "reasoning_content": "Easy: four.", "content": "4"},
        USER,
        {"role": "assistant", "reasoning_content": "Need data.", "tool_calls": [WEATHER_CALL]},
        {"role": "tool", "content": "7°C"},
    ],
    "reasoning_alias_and_inline_think": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nfour\n</think>\n\n4"},
        {"role": "user", "content": "3+3?"},
        {"role": "assistant", "reasoning": "six", "content": "6"},
    ],
}

TOOL_CONVERSATIONS = {"tool_round_trip", "tool_call_with_text_then_answer", "reasoning_history"}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(DEMO_DIR)


@pytest.fixture(scope="module")
def hf_tokenizer():
    return transformers.AutoTokenizer.from_pretrained(str(DEMO_DIR))


def _both(tokenizer, hf_tokenizer, messages, **kwargs) -> tuple[str, str]:
    ours = tokenizer.apply_chat_template(copy.deepcopy(messages), **kwargs)
    theirs = hf_tokenizer.apply_chat_template(copy.deepcopy(messages), tokenize=False, **kwargs)
    return ours, theirs


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("thinking", [{}, {"enable_thinking": False}, {"enable_thinking": True}])
def test_render_matches_transformers(
    tokenizer, hf_tokenizer, name, add_generation_prompt, thinking
):
    tools = TOOLS if name in TOOL_CONVERSATIONS else None
    ours, theirs = _both(
        tokenizer,
        hf_tokenizer,
        CONVERSATIONS[name],
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        **thinking,
    )
    assert ours == theirs


@pytest.mark.parametrize(
    "final_message",
    [
        {"role": "assistant", "content": "The weather is "},
        {"role": "assistant", "content": "Trailing space kept?  "},
        {"role": "assistant", "reasoning_content": "Look it up.", "content": "It is"},
        {"role": "assistant", "content": [{"type": "text", "text": "In parts: "}]},
    ],
)
def test_continue_final_message_matches_transformers(tokenizer, hf_tokenizer, final_message):
    messages = [USER, final_message]
    ours = tokenizer.apply_chat_template(copy.deepcopy(messages), continue_final_message=True)
    theirs = hf_tokenizer.apply_chat_template(
        copy.deepcopy(messages),
        tokenize=False,
        add_generation_prompt=False,
        continue_final_message=True,
    )
    assert ours == theirs
    assert not ours.endswith("<|im_end|>\n")


def test_demo_template_shape(tokenizer):
    """The demo template speaks Qwen3's dialect, which the tool and reasoning parsers expect."""
    prompt = tokenizer.apply_chat_template(CONVERSATIONS["tool_round_trip"], tools=TOOLS)
    assert prompt.startswith("<|im_start|>system\nYou are terse.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(TOOLS[0], ensure_ascii=False) + "\n" in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"' in prompt
    assert '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>' in prompt
    assert (
        "<|im_start|>user\n<tool_response>\n"
        '{"temp_c": 7}\n</tool_response>\n<tool_response>\n10:42\n</tool_response><|im_end|>\n'
    ) in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    no_think = tokenizer.apply_chat_template([USER], enable_thinking=False)
    assert no_think.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_render_leaves_caller_messages_untouched(tokenizer):
    messages = [USER, {"role": "assistant", "content": "Partial", "reasoning": "r"}]
    snapshot = copy.deepcopy(messages)
    tokenizer.apply_chat_template(messages, continue_final_message=True)
    assert messages == snapshot


GENERIC_TEMPLATE = """\
{%- set ns = namespace(count=0) %}
{%- for message in messages %}
    {%- if loop.index0 >= limit %}{% break %}{% endif %}
    {%- set ns.count = ns.count + 1 %}
[{{ message.role }}] {{ message.content | tojson }}
{%- endfor %}
{{ extra | tojson(indent=2, sort_keys=True) }}
{{ extra | tojson(separators=(',', ':')) }}
{{ dict(a=1) | tojson }} {{ ns.count }} {{ strftime_now('%Y') }} {{ bos_token }}|{{ eos_token }}
"""


def test_generic_template_features_match_transformers():
    messages = [
        {"role": "user", "content": 'naïve "quotes" <b>&</b>'},
        {"role": "assistant", "content": "中文"},
        {"role": "user", "content": "dropped by break"},
    ]
    kwargs = {"limit": 2, "extra": {"z": [1, 2], "a": "é"}, "eos_token": "</s>"}
    ours = ChatTemplate.from_string(GENERIC_TEMPLATE).render(
        messages, add_generation_prompt=False, **kwargs
    )
    theirs = render_jinja_template(
        conversations=[messages], chat_template=GENERIC_TEMPLATE, **kwargs
    )[0][0]
    assert ours == theirs
    assert '"naïve \\"quotes\\" <b>&</b>"' in ours


def _checkpoint(tmp_path: Path, *, config_template: object, jinja_file: str | None) -> Path:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    shutil.copy(DEMO_DIR / "tokenizer.json", model_dir)
    config = json.loads((DEMO_DIR / "tokenizer_config.json").read_text())
    config["chat_template"] = config_template
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja_file is not None:
        (model_dir / "chat_template.jinja").write_text(jinja_file)
    return model_dir


def _render_plain(model_dir: Path, **kwargs) -> str:
    return Tokenizer.from_dir(model_dir, **kwargs).apply_chat_template([USER])


def test_resolution_order(tmp_path, monkeypatch):
    model_dir = _checkpoint(tmp_path, config_template="config", jinja_file="jinja file")
    assert _render_plain(model_dir) == "jinja file"
    (model_dir / "chat_template.jinja").unlink()
    assert _render_plain(model_dir) == "config"

    override = tmp_path / "override.jinja"
    override.write_text("override")
    monkeypatch.setattr(
        chat_template_module,
        "package_template_path",
        lambda model_type: override if model_type == "qwen3" else None,
    )
    assert _render_plain(model_dir, model_type="qwen3") == "override"
    assert _render_plain(model_dir, model_type="llama") == "config"

    explicit = tmp_path / "explicit.jinja"
    explicit.write_text("explicit")
    assert _render_plain(model_dir, model_type="qwen3", chat_template_path=explicit) == "explicit"
    with pytest.raises(FileNotFoundError, match=r"no-such\.jinja"):
        Tokenizer.from_dir(model_dir, chat_template_path=tmp_path / "no-such.jinja")


def test_named_templates_pick_tool_use_with_tools(tmp_path):
    named = [
        {"name": "default", "template": "default:{{ tools is none }}"},
        {"name": "tool_use", "template": "tool_use:{{ tools | length }}"},
    ]
    model_dir = _checkpoint(tmp_path, config_template=named, jinja_file=None)
    tokenizer = Tokenizer.from_dir(model_dir)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    for tools in (None, TOOLS):
        ours = tokenizer.apply_chat_template([USER], tools=tools)
        theirs = hf_tokenizer.apply_chat_template(
            [USER], tools=tools, tokenize=False, add_generation_prompt=True
        )
        assert ours == theirs
    assert tokenizer.apply_chat_template([USER]) == "default:True"
    assert tokenizer.apply_chat_template([USER], tools=TOOLS) == "tool_use:2"


def test_named_templates_without_default(tmp_path):
    named = [{"name": "tool_use", "template": "t"}]
    tokenizer = Tokenizer.from_dir(_checkpoint(tmp_path, config_template=named, jinja_file=None))
    assert tokenizer.apply_chat_template([USER], tools=TOOLS) == "t"
    with pytest.raises(ChatTemplateError, match="no 'default'"):
        tokenizer.apply_chat_template([USER])


def test_missing_template_says_what_to_do(tmp_path):
    model_dir = _checkpoint(tmp_path, config_template=None, jinja_file=None)
    tokenizer = Tokenizer.from_dir(model_dir)
    assert not tokenizer.chat_template.is_available
    with pytest.raises(ValueError, match=r"has no chat template.*--chat-template FILE"):
        tokenizer.apply_chat_template([USER])


def test_malformed_config_template_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="must be a string or a list"):
        resolve_chat_template(tmp_path, config_template={"default": "x"})


def test_syntax_error_names_the_file(tmp_path):
    broken = tmp_path / "broken.jinja"
    broken.write_text("line one\n{% if %}")
    with pytest.raises(ValueError, match=r"broken\.jinja has a syntax error on line 2"):
        resolve_chat_template(tmp_path, config_template=None, chat_template_path=broken)


def test_raise_exception_carries_the_template_message(tokenizer):
    with pytest.raises(ChatTemplateError, match='unknown message role "robot"'):
        tokenizer.apply_chat_template([{"role": "robot", "content": "beep"}])
    template = ChatTemplate.from_string("{{ raise_exception('Only user and assistant roles!') }}")
    with pytest.raises(ValueError, match="Only user and assistant roles!"):
        template.render([USER])


def test_continue_final_message_needs_text(tokenizer):
    with pytest.raises(ChatTemplateError, match="no text content"):
        tokenizer.apply_chat_template(
            [USER, {"role": "assistant", "tool_calls": [WEATHER_CALL]}],
            continue_final_message=True,
        )
    hides_content = ChatTemplate.from_string("{% for m in messages %}{{ m.role }}{% endfor %}")
    with pytest.raises(ChatTemplateError, match="does not render the final message"):
        hides_content.render([USER], continue_final_message=True)


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ messages.__class__.__base__.__subclasses__() }}",
        "{{ cycler.__init__.__globals__ }}",
        "{{ raise_exception.__globals__ }}",
        "{% set ns = namespace() %}{% set ns.__dict__ = 1 %}",
        "{{ messages.append(1) }}",
    ],
)
def test_sandbox_blocks_escapes(source):
    with pytest.raises(ValueError):
        ChatTemplate.from_string(source).render([USER])
