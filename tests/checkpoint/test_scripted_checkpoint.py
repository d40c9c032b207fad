"""The scripted checkpoint (tests/scripted_checkpoint.py) is a Qwen3 checkpoint transformers
runs as it is, and greedy decoding there spells each reply: the server tests' premise, checked
without metrale's engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from metrale.tokenizer import Tokenizer
from tests.scripted_checkpoint import ScriptedCheckpoint, build_scripted_checkpoint

WEATHER_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
REPLIES = {
    " harmonic": WEATHER_CALL,
    # Two calls share their opening, so the second needs eight tokens of history.
    " percentile": WEATHER_CALL
    + '\n<tool_call>\n{"name": "book_taxi", "arguments": {"destination": "Louvre"}}'
    "\n</tool_call>",
    " correlation": "It is sunny in Paris, sunny in Rome, and sunny in Paris again.",
}
# " percentile" has none: after a tool result it writes its two calls again.
AFTER_TOOL = {
    " harmonic": "Done: it is sunny in Paris.",
    # Shares the plain reply's opening, so its third token needs ten tokens of history.
    " correlation": "It is 21 degrees in Paris.",
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
WEATHER_CALL_MESSAGE = {
    "role": "assistant",
    "content": "",
    "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    ],
}


def test_transformers_greedy_decoding_spells_each_reply(tmp_path):
    import transformers

    scripted = build_scripted_checkpoint(tmp_path, REPLIES)
    assert scripted.context_len == 8
    tokenizer = Tokenizer.from_dir(tmp_path)
    eos_id = tokenizer.token_to_id("<|im_end|>")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    for keyword in [*REPLIES, ""]:
        history = [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello! How can I help?"},
            {"role": "user", "content": f"What is the weather like in Paris?{keyword}"},
        ]
        prompt = tokenizer.encode(
            tokenizer.apply_chat_template(history, tools=tools), add_special_tokens=False
        )
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]), max_new_tokens=80, do_sample=False, eos_token_id=eos_id
            )
        reply_ids = out[0, len(prompt) :].tolist()
        expected = list(scripted.replies[keyword].token_ids) if keyword else []
        assert reply_ids == [*expected, eos_id], keyword  # no keyword: the reply ends at once
        if keyword:
            assert tokenizer.decode(reply_ids) == REPLIES[keyword]


@pytest.mark.parametrize(
    ("replies", "message"),
    [
        ({" harmonic": "Hi<|im_end|>\n<|im_start|>assistant\nThere"}, "in two ways"),
        ({" Paris two": "Hi"}, "it must be one"),
        ({" harmonic": "So harmonic"}, "in no reply"),
        ({" harmonic": "Hi", " median": "Hi"}, None),
    ],
)
def test_replies_it_cannot_spell_are_refused(tmp_path, replies, message):
    if message is None:
        build_scripted_checkpoint(tmp_path, replies)  # two keywords, one text: fine
        return
    with pytest.raises(ValueError, match=message):
        build_scripted_checkpoint(tmp_path, replies)


@pytest.fixture(scope="module")
def two_turns(tmp_path_factory: pytest.TempPathFactory) -> tuple[ScriptedCheckpoint, Any]:
    import transformers

    path = tmp_path_factory.mktemp("scripted")
    scripted = build_scripted_checkpoint(path, REPLIES, after_tool=AFTER_TOOL)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return scripted, model


def conversation(keyword: str, turns: str) -> list[dict[str, Any]]:
    """`turns` spells what follows the user's question: ``c`` a weather call, ``t`` its
    result, ``a`` a final answer, ``u`` another user message without a keyword."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": f"What is the weather like in Paris?{keyword}"},
    ]
    for turn in turns:
        messages.append(
            {
                "c": WEATHER_CALL_MESSAGE,
                "t": {"role": "tool", "content": '{"sky": "sunny", "celsius": 21}'},
                "a": {"role": "assistant", "content": "It is sunny."},
                "u": {"role": "user", "content": "And tomorrow?"},
            }[turn]
        )
    return messages


def generate(model: Any, path: Path, messages: list[dict[str, Any]], **sampling: Any) -> list[int]:
    tokenizer = Tokenizer.from_dir(path)
    eos_id = tokenizer.token_to_id("<|im_end|>")
    prompt = tokenizer.encode(
        tokenizer.apply_chat_template(messages, tools=TOOLS), add_special_tokens=False
    )
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=80,
            eos_token_id=eos_id,
            pad_token_id=eos_id,
            **(sampling or {"do_sample": False}),
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize(
    ("turns", "after_tool"),
    [
        ("", False),  # (a) a plain user prompt
        ("ct", True),  # (b) the call's result comes back
        ("cttt", True),  # several results, grouped into one user turn
        ("ctau", False),  # (c) a user message after the result
        ("ctu", False),  # a user message right after the result, in the same prompt
        ("ctact", True),  # a second round
    ],
)
@pytest.mark.parametrize("keyword", list(REPLIES))
def test_a_tool_result_picks_the_after_tool_reply(two_turns, keyword, turns, after_tool):
    scripted, model = two_turns
    tokenizer = Tokenizer.from_dir(scripted.path)
    eos_id = tokenizer.token_to_id("<|im_end|>")
    # (d) a keyword without an after-tool reply writes its reply again, as it always did.
    replies = scripted.after_tool_replies if after_tool else scripted.replies
    expected = replies.get(keyword, scripted.replies[keyword])
    reply_ids = generate(model, scripted.path, conversation(keyword, turns))
    assert reply_ids == [*expected.token_ids, eos_id]
    assert tokenizer.decode(reply_ids) == expected.text
    assert expected.after_tool == (after_tool and keyword in AFTER_TOOL)


def test_the_after_tool_replies_are_exposed_with_their_tokens(two_turns):
    scripted, _ = two_turns
    tokenizer = Tokenizer.from_dir(scripted.path)
    assert set(scripted.after_tool_replies) == set(AFTER_TOOL)
    assert set(scripted.replies) == set(REPLIES)
    for keyword, reply in scripted.after_tool_replies.items():
        assert reply.text == AFTER_TOOL[keyword]
        assert reply.keyword_id == scripted.replies[keyword].keyword_id
        assert tokenizer.decode(reply.token_ids) == AFTER_TOOL[keyword]
    # The generation prompt (7 tokens), the token before it and " It is" of " correlation".
    assert scripted.context_len == 10


def test_sampling_at_temperature_one_writes_the_greedy_reply(two_turns):
    """Each step's successor leads every other logit by far more than sampling can overturn."""
    scripted, model = two_turns
    tokenizer = Tokenizer.from_dir(scripted.path)
    torch.manual_seed(0)
    sampling = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
    for keyword in REPLIES:
        for turns in ["", "ct", "ctau"]:
            messages = conversation(keyword, turns)
            greedy = generate(model, scripted.path, messages)
            assert generate(model, scripted.path, messages, **sampling) == greedy
            prompt = tokenizer.encode(
                tokenizer.apply_chat_template(messages, tools=TOOLS), add_special_tokens=False
            )
            with torch.no_grad():
                logits = model(torch.tensor([prompt + greedy[:-1]])).logits[0, len(prompt) - 1 :]
            top2 = logits.topk(2, dim=-1)
            assert top2.indices[:, 0].tolist() == greedy
            lead = top2.values[:, 0] - top2.values[:, 1]
            assert lead.min() > 30, (keyword, turns, lead.min())


@pytest.mark.parametrize(
    ("after_tool", "message"),
    [
        ({" median": "Done"}, "have no reply"),
        # Past its own <|im_end|>, the after-tool reply looks like the plain one's start.
        ({" harmonic": "Hi<|im_end|>\n<|im_start|>assistant\nThere"}, "the after-tool reply"),
    ],
)
def test_after_tool_replies_it_cannot_spell_are_refused(tmp_path, after_tool, message):
    with pytest.raises(ValueError, match=message):
        build_scripted_checkpoint(tmp_path, {" harmonic": "Hi"}, after_tool=after_tool)
