"""Hostile chat templates: each is refused at load or stopped during the render with a clear
ChatTemplateError, nothing outside the template runs or is read, and no Python object's repr
reaches the prompt; real templates render exactly as before, in little time.

Renders that must be stopped by the clock run with a short time budget, so the suite stays fast;
one test keeps the default budget to show that it holds.
"""

from __future__ import annotations

import builtins
import copy
import io
import os
import time
import tracemalloc
from pathlib import Path

import jinja2.sandbox
import pytest

from metrale.tokenizer import (
    ChatTemplate,
    ChatTemplateBudgetError,
    ChatTemplateError,
    ChatTemplateSecurityError,
    RenderLimits,
)
from metrale.tokenizer.chat_template import TemplateSource
from metrale.tokenizer.template_sandbox import MAX_RANGE

USER = [{"role": "user", "content": "hi"}]
FAST = RenderLimits(time_s=0.25)
# What the repr of a Python object looks like; none may reach a rendered prompt.
OBJECT_REPRS = ("<class", "<function", "<built-in", "<bound", "object at 0x", "<module", "<Macro")


def render(source: str, messages=USER, limits: RenderLimits = FAST, **kwargs) -> str:
    template = ChatTemplate({"default": TemplateSource(source, "hostile.jinja")}, limits=limits)
    return template.render(messages, **kwargs)


def refused(source: str, error: type[ChatTemplateError], match: str, **kwargs) -> str:
    """Render ``source`` expecting ``error``; return its message."""
    with pytest.raises(error, match=match) as excinfo:
        output = render(source, **kwargs)
        assert not any(marker in output for marker in OBJECT_REPRS), output
    return str(excinfo.value)


# --- attribute escapes ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "attribute"),
    [
        ("{{ ''.__class__.__mro__ }}", "__class__"),
        ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "__class__"),
        ("{{ messages.__class__ }}", "__class__"),
        ("{{ messages.__class__.__base__.__subclasses__() }}", "__class__"),
        ("{{ raise_exception.__globals__ }}", "__globals__"),
        ("{{ raise_exception.__globals__['os'] }}", "__globals__"),
        ("{{ cycler.__init__.__globals__.os.popen('id').read() }}", "__init__"),
        ("{{ joiner.__init__.__globals__ }}", "__init__"),
        ("{{ namespace.__init__.__globals__ }}", "__init__"),
        ("{{ lipsum.__globals__['os'] }}", "__globals__"),
        ("{{ range.__globals__ }}", "__globals__"),
        ("{{ dict.__class__ }}", "__class__"),
        ("{{ strftime_now.__code__ }}", "__code__"),
        ("{% for x in messages %}{{ loop._iterable }}{% endfor %}", "_iterable"),
        ("{{ '{0.__class__}'.format(messages) }}", "__class__"),
        ("{{ '{0[__class__]}'.format(messages) }}", "__class__"),
        ("{{ '{m.__class__.__mro__}'.format_map({'m': messages}) }}", "__class__"),
        ("{{ ''.format.__globals__ }}", "__globals__"),
        ("{{ messages|attr('__class__') }}", "__class__"),
        ("{{ ('{0.__class__}'|attr('format'))(messages) }}", "__class__"),
        ("{{ ('{m.__class__}'|attr('format_map'))({'m': messages}) }}", "__class__"),
        ("{{ messages|map(attribute='__class__')|list }}", "__class__"),
        ("{{ messages|selectattr('__class__')|list }}", "__class__"),
        ("{{ messages|sort(attribute='__class__') }}", "__class__"),
        ("{{ messages['__class__'] }}", "__class__"),
        ("{{ (messages|map('upper')).gi_frame }}", "gi_frame"),
        ("{{ ''.__class__.mro() }}", "__class__"),
        ("{{ messages.append(1) }}", "append"),
        ("{{ messages[0].update({'role': 'system'}) }}", "update"),
    ],
)
def test_attribute_escapes_are_refused(source: str, attribute: str):
    message = refused(source, ChatTemplateSecurityError, "unsafe")
    assert repr(attribute) in message and "cannot reach Python internals" in message


@pytest.mark.parametrize(
    "source",
    [
        "{{ self._TemplateReference__context }}",
        "{{ self.__init__.__globals__ }}",
        "{% block b %}{{ self.b() }}{% endblock %}",
        "{% block b %}{% for i in range(100000) %}{{ 'x' * 4000000 }}{% endfor %}{% endblock %}"
        "{{ self.b() }}",
    ],
)
def test_self_is_refused_at_load(source: str):
    with pytest.raises(ChatTemplateSecurityError, match="uses `self` on line 1"):
        ChatTemplate.from_string(source)


def test_blocks_without_self_still_render():
    assert render("{% block b %}x{% endblock %}{{ 'y' }}") == "xy"


def test_namespace_refuses_underscore_attributes():
    refused(
        "{% set ns = namespace() %}{% set ns.__dict__ = 1 %}",
        ChatTemplateSecurityError,
        r"underscore attributes on a namespace \('__dict__'\)",
    )
    refused("{{ namespace(_x=1) }}", ChatTemplateSecurityError, "underscore attributes")


@pytest.mark.parametrize(
    "source",
    [
        "{{ raise_exception }}",
        "{{ cycler }}",
        "{{ joiner() }}{{ joiner }}",
        "{{ namespace(a=1) }}",
        "{{ [raise_exception] }}",
        "{{ {'f': strftime_now} }}",
        "{% for x in messages %}{{ loop }}{% endfor %}",
        "{% macro m() %}{% endmacro %}{{ m }}",
        "{{ messages|map(attribute='role') }}",  # a generator's repr
        "{{ '%s' % raise_exception }}",
        "{{ '' ~ cycler }}",
        "{{ '{}'.format(lipsum) }}",
        "{{ '{!r}'.format(joiner) }}",
        "{{ raise_exception|string }}",
        "{{ raise_exception|trim }}",
        "{{ [raise_exception]|join }}",
        "{{ dict(f=range)|pprint }}",
        "{{ raise_exception(raise_exception) }}",
    ],
)
def test_python_objects_never_turn_into_text(source: str):
    refused(source, ChatTemplateSecurityError, "only data .* into text")


def test_data_still_prints_as_python_prints_it():
    source = "{{ [1, 'a', none, true, 2.5] }} {{ {'k': (1, 2)} }} {{ range(3) }} {{ x.items() }}"
    assert render(source, x={"a": 1}) == (
        "[1, 'a', None, True, 2.5] {'k': (1, 2)} range(0, 3) dict_items([('a', 1)])"
    )


# --- files ------------------------------------------------------------------------------------


@pytest.fixture
def opened_paths(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every path opened through open(), io.open() or os.open() while the test runs."""
    paths: list[str] = []
    real_open, real_os_open = builtins.open, os.open

    def recording_open(file, *args, **kwargs):
        paths.append(str(file))
        return real_open(file, *args, **kwargs)

    def recording_os_open(path, *args, **kwargs):
        paths.append(str(path))
        return real_os_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", recording_open)
    monkeypatch.setattr(io, "open", recording_open)
    monkeypatch.setattr(os, "open", recording_os_open)
    return paths


@pytest.mark.parametrize(
    ("template", "tag"),
    [
        ("{% include '{path}' %}", "include"),
        ("{% include messages[0].content %}", "include"),
        ("{% include ['a', '{path}'] ignore missing %}", "include"),
        ("{% import '{path}' as y %}{{ y }}", "import"),
        ("{% from '{path}' import secret %}{{ secret }}", "from ... import"),
        ("line one\n{% extends '{path}' %}", "extends"),
    ],
)
def test_templates_cannot_read_files(tmp_path: Path, opened_paths: list[str], template, tag):
    sentinel = tmp_path / "sentinel.jinja"
    sentinel.write_text("SENTINEL-CONTENT {{ 7 * 6 }}")
    opened_paths.clear()
    source = template.replace("{path}", str(sentinel))
    with pytest.raises(ChatTemplateSecurityError) as excinfo:
        render(source, messages=[{"role": "user", "content": str(sentinel)}])
    message = str(excinfo.value)
    assert f"{{% {tag} %}}" in message and "hostile.jinja" in message
    assert "cannot read other templates or files" in message
    line = source.count("\n", 0, source.index("{%")) + 1
    assert f"on line {line}" in message
    assert not any("sentinel" in path for path in opened_paths), opened_paths
    assert "SENTINEL" not in message


def test_a_hostile_template_fails_at_load_not_at_the_first_request():
    with pytest.raises(ChatTemplateSecurityError, match="include"):
        ChatTemplate.from_string("{% if false %}{% include '/etc/passwd' %}{% endif %}")


def test_rendering_opens_no_file(opened_paths: list[str]):
    template = ChatTemplate.from_string(GENERIC_REAL_TEMPLATE)
    opened_paths.clear()
    template.render(CONVERSATION, tools=TOOLS, add_generation_prompt=True)
    assert opened_paths == []


# --- time -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "source",
    [
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "{% set r = range(100000)|list %}{% for i in r %}{% for j in r %}{% endfor %}{% endfor %}",
        "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
        "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}"
        "{{ f(60) }}",
        "{% set d = dict.fromkeys(range(100000), 1) %}"
        "{% for k in d %}{% for k2 in d %}{% endfor %}{% endfor %}",
        "{% set ns = namespace(l=[]) %}"
        "{% for i in range(100000) %}{% set ns.l = ns.l + [i] %}{% endfor %}",
        "{% set x %}{% for i in range(100000) %}{% for j in range(100000) %}ab{% endfor %}"
        "{% endfor %}{% endset %}",
        "{% filter upper %}{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
        "{% endfor %}{% endfilter %}",
    ],
)
def test_unbounded_loops_stop_at_the_time_budget(source: str):
    start = time.monotonic()
    refused(source, ChatTemplateBudgetError, r"ran past its time budget of 0\.25 s")
    assert time.monotonic() - start < 3.0


def test_the_default_time_budget_stops_a_loop_that_outputs_nothing():
    start = time.monotonic()
    with pytest.raises(ChatTemplateBudgetError, match=r"time budget of 2 s"):
        ChatTemplate.from_string(
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
        ).render(USER)
    assert 1.9 < time.monotonic() - start < 6.0


@pytest.mark.parametrize(
    "source",
    [
        "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
        "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
        "{% for x in [1] recursive %}{{ loop([1]) }}{% endfor %}",
        "{% macro a() %}{{ b() }}{% endmacro %}{% macro b() %}{{ a() }}{% endmacro %}{{ a() }}",
    ],
)
def test_endless_recursion_stops_at_the_call_depth(source: str):
    refused(source, ChatTemplateBudgetError, r"calls nest more than 64 deep")


def test_range_keeps_the_sandbox_cap():
    assert MAX_RANGE == jinja2.sandbox.MAX_RANGE == 100_000
    assert render("{{ range(100000)|list|length }}") == "100000"
    for source in (
        "{% for i in range(10**9) %}x{% endfor %}",
        "{{ range(100001)|list|length }}",
        "{{ range(10**30)|length }}",
        "{{ range(0, 10**12, 2)|list }}",
    ):
        refused(source, ChatTemplateBudgetError, r"ranges of at most 100,000")


# --- size -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "what"),
    [
        ("{{ 'x' * 10**10 }}", r"the result of \*"),
        ("{{ 10**10 * 'x' }}", r"the result of \*"),
        ("{% set x = 'a' * 10**9 %}", r"the result of \*"),
        ("{{ [0] * 10**9 }}", r"the result of \*"),
        ("{{ '%999999999d' % 1 }}", "the result of %"),
        ("{{ '%*d' % (10**9, 1) }}", "the result of %"),
        ("{{ ('%(a)s' * 1000) % {'a': 'x' * 100000} }}", "the result of %"),
        ("{{ '{:999999999}'.format(1) }}", r"str\.format's result"),
        ("{{ '{0:{1}}'.format(1, 10**9) }}", r"str\.format's result"),
        ("{{ '{:.999999999f}'.format(1.5) }}", r"str\.format's result"),
        ("{{ ('{0}' * 1000).format('x' * 100000) }}", r"str\.format's result"),
        ("{{ 'x'.ljust(10**9) }}", r"str\.ljust\(1,000,000,000\)"),
        ("{{ 'x'.zfill(10**9) }}", r"str\.zfill\(1,000,000,000\)"),
        ("{{ ('\t' * 1000).expandtabs(100000) }}", r"str\.expandtabs's result"),
        ("{{ ('a' * 100000).replace('a', 'b' * 1000) }}", r"str\.replace's result"),
        ("{{ ('x' * 1000000).join(range(1000)|map('string')) }}", r"str\.join's result"),
        ("{{ ('a' * 100000).translate({97: 'b' * 1000}) }}", r"str\.translate's result"),
        ("{{ (1).to_bytes(10**9, 'big')|length }}", r"int\.to_bytes\(1,000,000,000\)"),
        ("{{ ('{:999999999}'|attr('format'))(1) }}", r"str\.format's result"),
        ("{{ 'x'|center(10**9) }}", "a width of"),
        ("{{ 'x'|center(1000000000) }}", "a width of"),  # a constant: checked at compile too
        ("{{ range(100000)|join('x' * 1000000) }}", "the join filter's result"),
        ("{{ ('a' * 100000)|replace('a', 'b' * 1000) }}", "the replace filter's result"),
        ("{{ ('\n' * 100000)|indent(1000) }}", "the indent filter's result"),
        ("{{ ('a ' * 100000)|wordwrap(1, wrapstring='x' * 1000) }}", "the wordwrap filter's"),
        ("{{ [1]|batch(10**8, 0)|list }}", "the batch filter's padding"),
        ("{{ [1]|slice(10**8)|list }}", "the slice filter's"),
        ("{{ '%999999999d'|format(1) }}", "the format filter's result"),
        ("{{ range(10000)|list|tojson(indent=100000) }}", "the tojson filter's result"),
        ("{{ lipsum(100000) }}", r"lipsum\(100000"),
    ],
)
def test_growing_operations_are_refused_before_they_allocate(source: str, what: str):
    tracemalloc.start()
    try:
        refused(source, ChatTemplateBudgetError, what)
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak_bytes < 64 * 2**20  # the refused result would have been gigabytes


@pytest.mark.parametrize(
    "source",
    [
        # doubling a list, a shared list, a dict, a string: 2^100 after 100 steps
        "{% set ns = namespace(l=[1]) %}"
        "{% for i in range(100) %}{% set ns.l = ns.l + ns.l %}{% endfor %}",
        "{% set ns = namespace(l=[]) %}"
        "{% for i in range(100) %}{% set ns.l = [ns.l, ns.l] %}{% endfor %}{{ ns.l }}",
        "{% set ns = namespace(d={}) %}"
        "{% for i in range(100) %}{% set ns.d = {'a': ns.d, 'b': ns.d} %}{% endfor %}"
        "{{ ns.d|tojson }}",
        "{% set ns = namespace(t=(1,)) %}"
        "{% for i in range(100) %}{% set ns.t = (ns.t, ns.t) %}{% endfor %}{{ ns.t == ns.t }}",
        "{% set ns = namespace(s='x') %}"
        "{% for i in range(100) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
        "{% set ns = namespace(s='x') %}"
        "{% for i in range(100) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
        "{% set ns = namespace(d={}) %}"
        "{% for i in range(100) %}{% set ns.d = dict(a=ns.d, b=ns.d) %}{% endfor %}",
        "{% set big = 'x' * 1000000 %}{{ dict.fromkeys(range(100000), big)|length }}",
        "{% set ns = namespace(c=cycler('x' * 1000000)) %}"
        "{% for i in range(30) %}{% set ns.c = cycler(*(ns.c.items + ns.c.items)) %}{% endfor %}",
        # two distinct equal DAGs compare in exponential time unless refused while they grow
        "{% set ns = namespace(a=[], b=[]) %}{% for i in range(60) %}"
        "{% set ns.a = [ns.a, ns.a] %}{% set ns.b = [ns.b, ns.b] %}{% endfor %}{{ ns.a == ns.b }}",
    ],
)
def test_growth_in_a_loop_is_refused_at_the_size_budget(source: str):
    start = time.monotonic()
    refused(source, ChatTemplateBudgetError, "past the chat template's size budget")
    assert time.monotonic() - start < 2.0


def test_output_is_counted_as_it_is_generated():
    message = refused(
        "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",
        ChatTemplateBudgetError,
        r"output passed [\d,]+ bytes",
    )
    assert "size budget for this conversation" in message


def test_block_output_is_bounded_before_it_is_joined():
    refused(
        "{% set big = 'x' * 4000000 %}{% set x %}"
        "{% for i in range(100000) %}{{ big }}{% endfor %}{% endset %}",
        ChatTemplateBudgetError,
        "a block's output",
    )
    refused(
        "{% macro m() %}{{ caller() }}{{ caller() }}{% endmacro %}"
        "{% call m() %}{{ 'x' * 4000000 }}{% endcall %}",
        ChatTemplateBudgetError,
        "a block's output",
    )


def test_integers_are_bounded():
    refused("{{ 2 ** 1000000000 }}", ChatTemplateBudgetError, "integer of about")
    refused(
        "{% set ns = namespace(n=3) %}{% for i in range(40) %}{% set ns.n = ns.n * ns.n %}"
        "{% endfor %}",
        ChatTemplateBudgetError,
        "integers of up to 4,096 bits",
    )
    assert render("{{ 2 ** 64 }} {{ 10 ** 9 * 7 }}") == "18446744073709551616 7000000000"


def test_the_size_budget_scales_with_the_conversation():
    """A conversation far above the base budget renders; its budget grows with it."""
    content = "long message " * 500_000  # 6.5 MB, above the 4 MiB base
    messages = [{"role": "user", "content": content}, {"role": "assistant", "content": content}]
    text = ChatTemplate.from_string(GENERIC_REAL_TEMPLATE).render(messages, tools=TOOLS)
    assert text.count(content) == 2
    small = refused("{{ 'x' * 100000000 }}", ChatTemplateBudgetError, "size budget")
    large = refused(
        "{{ 'x' * 100000000 }}",
        ChatTemplateBudgetError,
        "size budget",
        messages=[{"role": "user", "content": "y" * 10_000_000}],
    )
    assert _budget_in(large) - _budget_in(small) >= 4 * (10_000_000 - 100)


def _budget_in(message: str) -> int:
    return int(message.split("size budget of ")[1].split(" ")[0].replace(",", ""))


def test_quadratic_filters_are_refused():
    refused("{{ ('<!--' * 1000)|striptags }}", ChatTemplateSecurityError, "striptags filter")
    refused("{{ 'see http://x.y'|urlize }}", ChatTemplateSecurityError, "urlize filter")
    refused(
        "{{ range(2000)|map('string')|map('list')|sum(start=[]) }}",
        ChatTemplateBudgetError,
        "sum filter over 2,000 sequences",
    )
    assert render("{{ [1, 2, 3]|sum }} {{ [[1], [2]]|sum(start=[]) }}") == "6 [1, 2]"


# --- load time --------------------------------------------------------------------------------


def test_templates_that_cannot_compile_fail_with_a_chat_template_error():
    with pytest.raises(ChatTemplateBudgetError, match="nests too deeply to compile"):
        ChatTemplate.from_string("{{ " + "(" * 500 + "1" + ")" * 500 + " }}")
    nested_loops = "".join(f"{{% for i{n} in range(2) %}}" for n in range(120))
    with pytest.raises(ChatTemplateBudgetError, match="nests too deeply to compile"):
        ChatTemplate.from_string(nested_loops + "x" + "{% endfor %}" * 120)
    with pytest.raises(ChatTemplateBudgetError, match=r"1,048,577 characters.*at most 1,048,576"):
        ChatTemplate.from_string("a" * (2**20 + 1))
    with pytest.raises(ChatTemplateError, match="syntax error on line 1"):
        ChatTemplate.from_string("{% for %}")


def test_template_bugs_are_chat_template_errors():
    """Python errors inside the template are the template's failure, answered with a 400."""
    for source, name in (
        ("{{ 1 / 0 }}", "ZeroDivisionError"),
        ("{{ 'a' + 1 }}", "TypeError"),
        ("{{ 10.0 ** 1000 }}", "OverflowError"),
        ("{{ 'x' is divisibleby 0 }}", "TypeError"),
    ):
        refused(source, ChatTemplateError, rf"hostile\.jinja failed: {name}")


# --- real templates ---------------------------------------------------------------------------

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City"},
                    "opts": {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}}},
                },
                "required": ["city"],
            },
        },
    }
]
CONVERSATION = [
    {"role": "system", "content": "Be terse."},
    {
        "role": "user",
        "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Bern?"}],
    },
    {
        "role": "assistant",
        "content": "<think>\nlook it up\n</think>\n\nChecking.",
        "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Bern"}}}
        ],
    },
    {"role": "tool", "content": '{"temp": 3}'},
    {"role": "tool", "content": "second"},
    {"role": "assistant", "content": "3 degrees."},
    {"role": "user", "content": "Thanks"},
]

# The constructs real templates (Qwen, Llama, Mistral, Hermes, Gemma) use, together.
GENERIC_REAL_TEMPLATE = """\
{%- macro schema(s, depth) -%}
  {%- if s is mapping -%}
    {%- for key, value in s|items if key != 'description' -%}
      {{- '\\n' ~ ' ' * depth ~ key ~ ': ' -}}
      {%- if value is mapping %}{{ schema(value, depth + 2) }}
      {%- elif value is sequence and value is not string %}{{ value|join(', ') }}
      {%- else %}{{ value|string }}{% endif -%}
    {%- endfor -%}
  {%- endif -%}
{%- endmacro -%}
{%- macro text(content) -%}
  {%- if content is string %}{{ content }}
  {%- else -%}
    {{ content|selectattr('type', 'equalto', 'text')|map(attribute='text')|join('') }}
  {%- endif -%}
{%- endmacro -%}
{{- bos_token if bos_token is defined else '' -}}
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages[::-1] -%}
  {%- if ns.last_user < 0 and m.role == 'user' -%}
    {%- set ns.last_user = messages|length - 1 - loop.index0 -%}
  {%- endif -%}
{%- endfor -%}
{%- if messages[0].role == 'system' -%}
  {%- set system = messages[0].content|trim %}{% set rest = messages[1:] -%}
{%- else %}{% set system = '' %}{% set rest = messages %}{% endif -%}
<|system|>{{ system }}{% if tools %}
# Tools ({{ tools|length }}), this year has {{ strftime_now('%Y')|length }} digits
{%- for t in tools %}
{{ t|tojson(indent=2) }}
{{- schema(t.function.parameters, 0) }}
{%- endfor %}{% endif %}
{%- for m in rest %}
  {%- set content = text(m.content) -%}
  {%- if m.role == 'assistant' -%}
    {%- set reasoning = '' -%}
    {%- if '</think>' in content -%}
      {%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') -%}
      {%- set content = content.split('</think>')[-1].lstrip('\\n') -%}
    {%- endif %}
<|assistant|>{% if reasoning and loop.index0 < ns.last_user %}[{{ reasoning }}]{% endif -%}
{{ content }}
    {%- for call in m.tool_calls|default([], true) %}
<call>{{ {'name': call.function.name, 'arguments': call.function.arguments}|tojson }}</call>
    {%- endfor -%}
  {%- elif m.role == 'tool' -%}
    {%- if loop.previtem is defined and loop.previtem.role != 'tool' %}
<|tools|>{% endif %}
<result n="{{ loop.index }}/{{ loop.length }}">{{ '%s' % content }}</result>
    {%- if loop.nextitem is not defined or loop.nextitem.role != 'tool' %}</|tools|>{% endif -%}
  {%- elif m.role in ['user', 'system'] %}
<|{{ m.role }}|>{{ '{}: {}'.format(loop.index, content) }}
  {%- else -%}
    {{ raise_exception('unknown role ' ~ m.role) }}
  {%- endif -%}
{%- endfor %}
{% for x in [[1, [2]], [3]] recursive -%}
  ({% if x is iterable %}{{ loop(x) }}{% else %}{{ x }}{% endif %})
{%- endfor %}
{{ (messages|map(attribute='role')|unique|list|sort|join(','))|upper|center(40)|trim }}
{%- if add_generation_prompt %}
<|assistant|>{% if enable_thinking is defined and not enable_thinking %}[]{% endif %}
{%- endif %}
"""


@pytest.mark.parametrize("tools", [None, TOOLS])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_real_template_constructs_render_exactly_as_in_transformers(tools, add_generation_prompt):
    transformers = pytest.importorskip("transformers.utils.chat_template_utils")
    kwargs = {"bos_token": "<s>", "enable_thinking": False}
    ours = ChatTemplate.from_string(GENERIC_REAL_TEMPLATE).render(
        copy.deepcopy(CONVERSATION),
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        **kwargs,
    )
    theirs = transformers.render_jinja_template(
        conversations=[copy.deepcopy(CONVERSATION)],
        tools=tools,
        chat_template=GENERIC_REAL_TEMPLATE,
        add_generation_prompt=add_generation_prompt,
        **kwargs,
    )[0][0]
    assert ours == theirs
    assert "<call>" in ours and "[look it up]" in ours and "((1)((2)))((3))" in ours


def test_a_long_real_conversation_renders_well_within_the_budget():
    turns = [
        message
        for n in range(1000)
        for message in (
            {"role": "user", "content": f"question {n} " * 50},
            {"role": "assistant", "content": f"answer {n} " * 50},
        )
    ]
    template = ChatTemplate.from_string(GENERIC_REAL_TEMPLATE)
    start = time.monotonic()
    text = template.render([{"role": "system", "content": "s"}, *turns], tools=TOOLS)
    assert time.monotonic() - start < 1.0  # the budget is 2 s
    assert "answer 999" in text
