"""`met serve --speculative-config ngram` on a scripted checkpoint that repeats itself: the reply,
streamed and not, is the script's to the byte (several tokens a step reach the client whole),
and `/metrics` counts the drafts and the accepted tokens, by position, under vLLM's names."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.scripted_checkpoint import ScriptedCheckpoint, build_scripted_checkpoint
from tests.server.conftest import MODEL_NAME, RunningServer, serving

KEYWORD = " harmonic"
REPLY = "Check the cache, then the disk, then the network. " * 3 + "Check the logs instead."


@pytest.fixture(scope="module")
def scripted(tmp_path_factory: pytest.TempPathFactory) -> ScriptedCheckpoint:
    return build_scripted_checkpoint(tmp_path_factory.mktemp("repeating"), {KEYWORD: REPLY})


@pytest.fixture(scope="module")
def speculating(scripted, tmp_path_factory) -> Iterator[RunningServer]:
    log_path = tmp_path_factory.mktemp("serve-speculation") / "server.log"
    args = ("--speculative-config", "ngram", "--num-speculative-tokens", "6")
    with serving(scripted.path, log_path, *args) as running:
        yield running


def counters(server: RunningServer) -> dict[str, float]:
    """The spec_decode series of /metrics, by name and labels."""
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    found = {}
    for line in text.splitlines():
        if line.startswith("metrale:spec_decode_"):
            name, value = line.rsplit(" ", 1)
            found[name] = float(value)
    return found


def test_replies_are_the_script_and_the_metrics_count_the_drafts(speculating):
    client = openai.OpenAI(base_url=speculating.api_url, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": f"Say it{KEYWORD}."}]
    reply = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=200)
    assert reply.choices[0].message.content == REPLY
    assert reply.usage.completion_tokens == len(openai_tokens(speculating, REPLY)) + 1
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=200, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == REPLY
    with_logprobs = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=200, logprobs=True, top_logprobs=2
    )
    content = with_logprobs.choices[0].logprobs.content
    # every token's, accepted drafts too (the end token's as well, as without drafts)
    assert "".join(t.token for t in content).startswith(REPLY)
    assert len(content) == with_logprobs.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 for t in content)
    found = counters(speculating)
    accepted = found[f'metrale:spec_decode_num_accepted_tokens_total{{model_name="{MODEL_NAME}"}}']
    drafted = found[f'metrale:spec_decode_num_draft_tokens_total{{model_name="{MODEL_NAME}"}}']
    assert 0 < accepted < drafted
    per_position = "metrale:spec_decode_num_accepted_tokens_per_pos_total"
    first = found[f'{per_position}{{model_name="{MODEL_NAME}",position="0"}}']
    assert 0 < first <= accepted
    config = httpx.get(speculating.base_url + "/serve-config", timeout=10).json()
    assert config["engine"]["speculative"]["num_speculative_tokens"] == 6


def openai_tokens(server: RunningServer, text: str) -> list[int]:
    body = {"model": MODEL_NAME, "prompt": text}
    return httpx.post(server.base_url + "/tokenize", json=body, timeout=10).json()["tokens"]


@pytest.fixture(scope="module")
def sharing(scripted, tmp_path_factory) -> Iterator[RunningServer]:
    log_path = tmp_path_factory.mktemp("serve-shared-lookup") / "server.log"
    args = (
        "--speculative-config",
        "ngram",
        "--num-speculative-tokens",
        "6",
        "--shared-lookup",
        "--no-speculation-cost-model",  # every request drafts: the test counts drafts
        "--api-key",
        "alice-key",
        "--api-key",
        "bob-key",
    )
    with serving(scripted.path, log_path, *args) as running:
        yield running


def accepted_with(server: RunningServer, key: str) -> float:
    """The drafts accepted while the client with `key` gets the script's reply once."""
    name = f'metrale:spec_decode_num_accepted_tokens_total{{model_name="{MODEL_NAME}"}}'
    before = counters_with(server, key).get(name, 0.0)
    client = openai.OpenAI(base_url=server.api_url, api_key=key, max_retries=0)
    messages = [{"role": "user", "content": f"Say it{KEYWORD}."}]
    reply = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=200)
    assert reply.choices[0].message.content == REPLY
    return counters_with(server, key)[name] - before


def counters_with(server: RunningServer, key: str) -> dict[str, float]:
    text = httpx.get(
        server.base_url + "/metrics", headers={"authorization": f"Bearer {key}"}, timeout=10
    ).text
    return {
        name: float(value)
        for name, value in (line.rsplit(" ", 1) for line in text.splitlines())
        if name.startswith("metrale:spec_decode_")
    }


def test_a_tenants_finished_text_drafts_its_next_request_and_only_its(sharing):
    """Its own text drafts only the later copies of a reply; the shared table, fed by the
    tenant's first request, drafts the first copy of the next one too. Another tenant starts
    from its own text alone."""
    alone = accepted_with(sharing, "alice-key")
    again = accepted_with(sharing, "alice-key")
    other = accepted_with(sharing, "bob-key")
    assert again > alone
    assert other == alone
