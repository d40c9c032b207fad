"""Differential tests of the reasoning parser: every splitting of an output must give the same
reasoning and content, equal to what the fixture expects."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from metrale.frontend.reasoning import (
    ReasoningDelta,
    ReasoningEvent,
    collect_reasoning,
    make_reasoning_parser,
    prompt_opens_reasoning,
    reasoning_parser_names,
)
from metrale.frontend.tool_parsers import ContentDelta
from tests.frontend.splits import char_bursts, splittings

# (name, output text, expected reasoning, expected content)
Fixture = tuple[str, str, str, str]

QWEN3: list[Fixture] = [
    ("no_tags", "Just content.", "", "Just content."),
    (
        "block_then_content",
        "<think>\nLet me think.\n</think>\n\nIt is 4.",
        "Let me think.",
        "It is 4.",
    ),
    ("empty_block_is_a_no_op", "<think>\n\n</think>\n\nHi there", "", "Hi there"),
    (
        "inner_newlines_kept",
        "<think>\nstep 1\n\nstep 2\n</think>\n\nDone",
        "step 1\n\nstep 2",
        "Done",
    ),
    ("several_blocks_concatenate", "<think>a</think>x<think>b</think>y", "ab", "xy"),
    ("truncated_in_reasoning", "<think>\nstill thinking", "still thinking", ""),
    ("partial_end_tag_at_end", "<think>\nhmm </thi", "hmm </thi", ""),
    ("partial_start_tag_at_end", "Answer <thi", "", "Answer <thi"),
    ("stray_end_tag_dropped", "no block</think>\n\nrest", "", "no blockrest"),
    ("content_before_block", "Intro\n<think>\nr\n</think>\n\nOutro", "r", "Intro\nOutro"),
    ("unicode", "<think>\n考虑一下 🤔\n</think>\n\n答案：四", "考虑一下 🤔", "答案：四"),
    (
        "tool_call_after_reasoning",
        '<think>\nuse a tool\n</think>\n\n<tool_call>\n{"name": "f"}\n</tool_call>',
        "use a tool",
        '<tool_call>\n{"name": "f"}\n</tool_call>',
    ),
    ("only_layout_after_block", "<think>x</think>\n\n", "x", ""),
    ("similar_tag_is_text", "a <thinking> b", "", "a <thinking> b"),
    (
        "angle_brackets_in_reasoning",
        "<think>a < b and </th> no</think>ok",
        "a < b and </th> no",
        "ok",
    ),
    (
        "start_tag_inside_reasoning_is_text",
        "<think>I write <think> here</think>ok",
        "I write <think> here",
        "ok",
    ),
    ("leading_newlines_kept_without_block", "\n\nHello", "", "\n\nHello"),
]

DEEPSEEK_R1: list[Fixture] = [
    ("reasoning_then_content", "Let me think.\n</think>\n\nAnswer", "Let me think.", "Answer"),
    ("leading_newline", "\nthink\n</think>\n\nA", "think", "A"),
    ("model_repeats_seeded_start_tag", "<think>\nthink\n</think>\n\nA", "think", "A"),
    ("no_end_tag_is_all_reasoning", "all reasoning, cut off", "all reasoning, cut off", ""),
    ("empty_reasoning", "</think>\n\nDirect", "", "Direct"),
    ("second_block", "r1</think>c1<think>r2</think>c2", "r1r2", "c1c2"),
    ("truncated_partial_start_tag", "<thi", "<thi", ""),
    ("start_tag_later_is_text", "a <think> b</think>c", "a <think> b", "c"),
    ("unicode", "Ünïcödé 推理\n</think>\n\nOk ✓", "Ünïcödé 推理", "Ok ✓"),
    ("newlines_only", "\n\n", "", ""),
    ("repeated_start_then_end", "<think></think>Hi", "", "Hi"),
    ("partial_end_tag_at_end", "thinking</thin", "thinking</thin", ""),
    (
        "tool_call_in_content",
        "r</think>\n\n<tool_call>x</tool_call>",
        "r",
        "<tool_call>x</tool_call>",
    ),
    ("second_end_tag_dropped", "r</think>c</think>d", "r", "cd"),
    ("spaces_are_not_layout", "  r  </think>  c", "  r  ", "  c"),
]

SEEDED_PROMPT = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n"
CLOSED_PROMPT = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"

# (config id, parser name, rendered prompt or None, fixtures)
CONFIGS: list[tuple[str, str, str | None, list[Fixture]]] = [
    ("qwen3", "qwen3", None, QWEN3),
    ("deepseek_r1", "deepseek_r1", None, DEEPSEEK_R1),
    ("qwen3_seeded_by_prompt", "qwen3", SEEDED_PROMPT, DEEPSEEK_R1),
    ("deepseek_r1_closed_by_prompt", "deepseek_r1", CLOSED_PROMPT, QWEN3),
]

CASES = [
    pytest.param(parser, prompt, fixture, id=f"{config}-{fixture[0]}")
    for config, parser, prompt, fixtures in CONFIGS
    for fixture in fixtures
]


def parse(name: str, prompt: str | None, deltas: Sequence[str]) -> list[ReasoningEvent]:
    parser = make_reasoning_parser(name, prompt=prompt)
    events: list[ReasoningEvent] = []
    for delta in deltas:
        events += parser.feed(delta)
    events += parser.finish()
    return events


def check_invariants(events: list[ReasoningEvent]) -> None:
    for event in events:
        assert isinstance(event, ReasoningDelta | ContentDelta) and event.text


@pytest.mark.parametrize(("parser", "prompt", "fixture"), CASES)
def test_every_splitting_parses_to_the_expected_result(
    parser: str, prompt: str | None, fixture: Fixture
) -> None:
    name, text, reasoning, content = fixture
    for split_name, deltas in splittings(text, f"{parser}-{name}").items():
        events = parse(parser, prompt, deltas)
        check_invariants(events)
        assert collect_reasoning(events) == (reasoning, content), f"{split_name}: {deltas!r}"


def test_each_parser_has_enough_fixtures() -> None:
    assert reasoning_parser_names() == ["deepseek_r1", "qwen3"]
    assert len(QWEN3) >= 15 and len(DEEPSEEK_R1) >= 15


def test_prompt_tells_a_seeded_block() -> None:
    parser = make_reasoning_parser("qwen3")
    fmt = parser._fmt
    assert prompt_opens_reasoning(SEEDED_PROMPT, fmt)
    assert not prompt_opens_reasoning(CLOSED_PROMPT, fmt)
    assert not prompt_opens_reasoning("<|im_start|>assistant\n", fmt)


def test_partial_tags_are_held_not_emitted() -> None:
    parser = make_reasoning_parser("qwen3")
    assert parser.feed("Hi <thi") == [ContentDelta("Hi ")]
    assert parser.feed("nk>\nidea\n") == [ReasoningDelta("idea")]
    assert parser.feed("</th") == []
    assert parser.feed("ink>\n\nok") == [ContentDelta("ok")]
    assert parser.finish() == []


def test_unknown_parser_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="deepseek_r1"):
        make_reasoning_parser("o1")


FRAGMENTS = ["<think>", "</think>", "<thi", "</th", "\n", "\n\n", "a", "b c", "é", "<", ">"]


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_random_outputs_never_disagree(parser: str) -> None:
    rng = random.Random(f"reasoning-{parser}")
    for _ in range(300):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 20)))
        whole = collect_reasoning(parse(parser, None, [text]))
        for deltas in (list(text), char_bursts(text, rng), char_bursts(text, rng, 3)):
            events = parse(parser, None, deltas)
            check_invariants(events)
            assert collect_reasoning(events) == whole, repr(text)
