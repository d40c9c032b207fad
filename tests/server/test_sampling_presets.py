"""Sampling presets end to end: a checkpoint's MODEL.toml `[sampling.thinking]` and
`[sampling.non_thinking]` set what a request leaves unset, by whether the turn thinks; the
request's own values win; `/serve-config` says which presets are in force and from where."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import httpx
import pytest

from tests.server.conftest import MODEL_NAME, RunningServer, serving

# Thinking turns sample hot; turns that do not think keep only the top token (so they are
# greedy whatever the temperature).
PRESETS = """
[sampling.thinking]
temperature = 2.0

[sampling.non_thinking]
temperature = 1.5
top_k = 1
"""


@pytest.fixture(scope="module")
def preset_server(qwen3_dir, tmp_path_factory) -> Iterator[RunningServer]:
    model_dir = tmp_path_factory.mktemp("presets") / "model"
    shutil.copytree(qwen3_dir, model_dir)
    (model_dir / "MODEL.toml").write_text(PRESETS)
    log_path = model_dir.parent / "server.log"
    # the reasoning parser is what tells a thinking turn from one that is not
    with serving(model_dir, log_path, "--reasoning-parser", "qwen3") as running:
        yield running


def reply(server: RunningServer, thinking: bool, **extra) -> list[int]:
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "Tell me a story."}],
        "max_tokens": 8,
        "chat_template_kwargs": {"enable_thinking": thinking},
        "logprobs": True,
        **extra,
    }
    response = httpx.post(server.api_url + "/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return [t["token"] for t in response.json()["choices"][0]["logprobs"]["content"]]


def test_the_preset_follows_whether_the_turn_thinks(preset_server):
    greedy = reply(preset_server, False, temperature=0)
    # not thinking: top_k 1 from the preset, so the hot temperature changes nothing
    assert reply(preset_server, False) == greedy
    assert reply(preset_server, False, seed=1) == reply(preset_server, False, seed=2)
    # thinking: temperature 2 and no top-k: seeded replies differ
    hot = [reply(preset_server, True, seed=s) for s in (1, 2, 3)]
    assert len({tuple(h) for h in hot}) > 1


def test_a_requests_own_values_win_over_the_preset(preset_server):
    greedy_thinking = reply(preset_server, True, temperature=0)
    assert reply(preset_server, True, temperature=0, seed=4) == greedy_thinking
    # a request's top_k widens the non-thinking preset's: sampling is hot again
    wide = [reply(preset_server, False, top_k=0, seed=s) for s in (1, 2, 3)]
    assert len({tuple(w) for w in wide}) > 1


def test_serve_config_names_the_presets_and_their_source(preset_server):
    config = httpx.get(preset_server.base_url + "/serve-config", timeout=10).json()
    assert "MODEL.toml" in config["behavior_sources"]["sampling_presets"]
    presets = config["server"]["sampling_presets"]
    assert presets == {
        "thinking": {"temperature": 2.0},
        "non_thinking": {"temperature": 1.5, "top_k": 1},
    }


def test_a_preset_sets_the_penalties_a_request_leaves_unset(tmp_path):
    """Penalties, DRY and the LZ penalty come from a preset too; a request's own value (even
    the engine's default, sent explicitly) wins."""
    from metrale.recipes import parse_sampling
    from metrale.server.protocol import ChatCompletionRequest

    presets = parse_sampling(
        {
            "non_thinking": {
                "presence_penalty": 1.5,
                "dry_multiplier": 0.8,
                "dry_allowed_length": 3,
                "lz_penalty": 0.2,
            }
        },
        "MODEL.toml [sampling]",
    )
    defaults = presets.for_turn(False)
    unset = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    params = unset.sampling_params(16, None, defaults)
    assert (params.presence_penalty, params.dry_multiplier) == (1.5, 0.8)
    assert (params.dry_allowed_length, params.lz_penalty) == (3, 0.2)
    own = ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi"}], presence_penalty=0.0, lz_penalty=0.0
    )
    params = own.sampling_params(16, None, defaults)
    assert (params.presence_penalty, params.lz_penalty, params.dry_multiplier) == (0.0, 0.0, 0.8)
