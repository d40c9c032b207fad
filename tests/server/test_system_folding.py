"""Templates that refuse system turns past the first: the prompt folds them into the first one.

Qwen3.5's template raises "System message must be at the beginning." for a system (or
developer) turn anywhere but first; Claude Code and Codex send such turns. The template here is
the demo's with that check added, rendered by the real tokenizer and sandbox.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from metrale.server.chat_request import build_prompt, fold_system_messages
from metrale.server.errors import APIError
from metrale.server.protocol import ChatCompletionRequest
from metrale.server.state import ServerSettings
from metrale.tokenizer import Tokenizer
from tests.conftest import TOKENIZER_FILES, demo_tokenizer_dir

STRICT = (
    "{%- for message in messages %}{%- if message.role == 'system' and not loop.first %}"
    "{{- raise_exception('System message must be at the beginning.') }}{%- endif %}"
    "{%- if 'FORBIDDEN' in message.content %}{{- raise_exception('No forbidden words.') }}"
    "{%- endif %}{%- endfor %}"
)


@pytest.fixture(scope="module")
def state(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    model_dir = tmp_path_factory.mktemp("strict-template")
    for name in TOKENIZER_FILES:
        shutil.copy(demo_tokenizer_dir() / name, model_dir / name)
    template = Path(model_dir / "chat_template.jinja")
    template.write_text(STRICT + template.read_text())
    tokenizer = Tokenizer.from_dir(model_dir)
    return SimpleNamespace(tokenizer=tokenizer, settings=ServerSettings(served_model_name="m"))


def request(*messages: tuple[str, str]) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": r, "content": c} for r, c in messages])


def test_later_system_turns_fold_into_the_first(state):
    text, ids = build_prompt(
        state,
        request(
            ("system", "Be brief."), ("user", "hi"), ("developer", "Tools changed."), ("user", "go")
        ),
    )
    expected, _ = build_prompt(
        state, request(("system", "Be brief.\n\nTools changed."), ("user", "hi"), ("user", "go"))
    )
    assert text == expected and ids
    assert text.count("<|im_start|>system") == 1


def test_a_first_system_turn_is_made_when_there_is_none(state):
    text, _ = build_prompt(state, request(("user", "hi"), ("system", "Late rule.")))
    assert text.startswith("<|im_start|>system\nLate rule.")


def test_other_template_errors_stay_400s(state):
    assert fold_system_messages([{"role": "user", "content": "x"}]) is None
    with pytest.raises(APIError, match="System message must be at the beginning"):
        build_prompt(state, request(("user", "hi"), ("system", "Late."), ("user", "FORBIDDEN")))
    with pytest.raises(APIError, match="No forbidden words"):
        build_prompt(state, request(("user", "FORBIDDEN")))
