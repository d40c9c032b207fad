"""`--scheduler` through the server: a request's `priority` (vLLM's field) is served under the
priority policy and refused, with the flag to use named, under the default fifo."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server.conftest import MODEL_NAME, serving


def test_priority_needs_the_priority_scheduler(server):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(
            model=MODEL_NAME, prompt="hi", max_tokens=2, extra_body={"priority": 3}
        )
    assert e.value.body["param"] == "priority"
    assert "--scheduler priority" in e.value.body["message"]
    # the default priority is no request for priority: served as ever
    ok = client.completions.create(
        model=MODEL_NAME, prompt="hi", max_tokens=2, extra_body={"priority": 0}
    )
    assert ok.choices[0].finish_reason == "length"


def test_a_priority_server_serves_requests_of_any_priority(qwen3_dir, tmp_path):
    with serving(qwen3_dir, tmp_path / "server.log", "--scheduler", "priority") as server:
        config = httpx.get(server.base_url + "/serve-config").json()
        assert config["engine"]["scheduler"]["policy"] == "priority"
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x")
        for priority in (-7, 0, 12):
            chat = client.chat.completions.create(
                model=MODEL_NAME,
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=3,
                extra_body={"priority": priority, "ignore_eos": True},
            )
            assert chat.usage.completion_tokens == 3
        with pytest.raises(openai.BadRequestError):  # still an int64, as every integer is
            client.completions.create(
                model=MODEL_NAME, prompt="hi", max_tokens=2, extra_body={"priority": 2**70}
            )
