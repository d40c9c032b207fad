"""The scripted checkpoint (tests/scripted_checkpoint.py) is a Qwen3 checkpoint transformers
runs as it is, and greedy decoding there spells each reply: the server tests' premise, checked
without metrale's engine."""

from __future__ import annotations

import pytest
import torch

from metrale.tokenizer import Tokenizer
from tests.scripted_checkpoint import build_scripted_checkpoint

WEATHER_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
REPLIES = {
    " harmonic": WEATHER_CALL,
    # Two calls share their opening, so the second needs eight tokens of history.
    " percentile": WEATHER_CALL
    + '\n<tool_call>\n{"name": "book_taxi", "arguments": {"destination": "Louvre"}}'
    "\n</tool_call>",
    " correlation": "It is sunny in Paris, sunny in Rome, and sunny in Paris again.",
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
