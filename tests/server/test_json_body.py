"""JSON bodies and SSE frames: every response is JSON, whatever numbers a model produces."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import openai
import pytest
from fastapi.testclient import TestClient

from metrale.engine_args import EngineArgs
from metrale.frontend.output_processor import CompletionDelta
from metrale.outputs import Logprob
from metrale.server import sse
from metrale.server.app import build_app
from metrale.server.errors import MAX_JSON_DEPTH, APIError, check_json_values
from metrale.server.json_body import JSONResponse, dumps
from metrale.server.openai.logprobs import LOGPROB_FLOOR
from metrale.server.state import ServerSettings, ServerState
from metrale.telemetry.hub import Telemetry
from metrale.tokenizer import Tokenizer


def _strict(data: bytes | str):
    """JSON as a browser's `JSON.parse` reads it: no NaN or Infinity."""

    def refuse(name: str):
        raise ValueError(f"{name} is not JSON")

    return json.loads(data, parse_constant=refuse)


def test_a_frame_is_one_compact_json_data_line():
    payload = {"id": "x", "choices": [{"text": "héllo \n😀", "logprobs": None, "index": 0}]}
    frame = sse.event(payload)
    assert frame.startswith(b"data: ") and frame.endswith(b"\n\n") and frame.count(b"\n") == 2
    assert _strict(frame[6:-2]) == payload
    assert "héllo".encode() in frame  # UTF-8, not \\u escapes


def test_a_named_frame_carries_its_event_line():
    assert sse.event({"type": "ping"}, "ping") == b'event: ping\ndata: {"type":"ping"}\n\n'


@pytest.mark.parametrize("value", [float("-inf"), float("inf"), float("nan")])
def test_numbers_json_lacks_become_null_in_bodies_and_frames(value):
    payload = {"logprob": value, "top": {"a": value}}
    want = {"logprob": None, "top": {"a": None}}
    assert _strict(sse.event(payload)[6:-2]) == want
    assert _strict(JSONResponse(payload).body) == want


def test_what_msgspec_cannot_encode_is_still_json():
    huge = 2**70  # past 64 bits
    assert json.loads(dumps({"seed": huge})) == {"seed": huge}


class BrokenLogprobsLLM:
    """A scripted engine whose every position has a NaN logprob for the sampled token and -inf
    for the runner-up: what a forward that overflowed, or a token ruled out, reports."""

    is_alive = True
    client = SimpleNamespace(kv_cache=None, dead_reason=None, forward=None)

    def __init__(self) -> None:
        self.telemetry = Telemetry(None)

    async def generate(self, request, api="unknown", coalesce=True):
        for i, token_id in enumerate((11, 12, 13)):
            position = {
                token_id: Logprob(math.nan, 1, None),
                token_id + 100: Logprob(-math.inf, 2, None),
            }
            yield CompletionDelta(
                request.request_id,
                [token_id],
                f"t{i}",
                [position],
                finish_reason="length" if i == 2 else None,
                num_prompt_tokens=len(request.prompt_token_ids),
            )


@pytest.fixture(scope="module")
def client(qwen3_dir) -> openai.OpenAI:
    config = EngineArgs(model_from_path=str(qwen3_dir), device="cpu").create_config()
    state = ServerState(
        BrokenLogprobsLLM(),
        Tokenizer.from_dir(qwen3_dir),
        config,
        ServerSettings(served_model_name="m"),
    )
    return openai.OpenAI(
        base_url="http://testserver/v1",
        api_key="x",
        max_retries=0,
        http_client=TestClient(build_app(state)),
    )


def test_logprobs_past_the_floor_are_reported_at_it(client):
    """Not a 500 (starlette's encoder refuses NaN), not invalid JSON: OpenAI's floor."""
    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(
        model="m", messages=messages, logprobs=True, top_logprobs=2, max_tokens=3
    )
    for position in chat.choices[0].logprobs.content:
        assert position.logprob == LOGPROB_FLOOR
        assert [top.logprob for top in position.top_logprobs] == [LOGPROB_FLOOR] * 2
    streamed = client.completions.create(
        model="m", prompt="hi", logprobs=2, max_tokens=3, stream=True
    )
    values = [
        lp
        for chunk in streamed
        for lp in (chunk.choices[0].logprobs.token_logprobs if chunk.choices[0].logprobs else [])
    ]
    assert values == [LOGPROB_FLOOR] * 3
    whole = client.completions.create(model="m", prompt="hi", logprobs=2, max_tokens=3)
    assert whole.choices[0].logprobs.token_logprobs == [LOGPROB_FLOOR] * 3
    assert all(
        v == LOGPROB_FLOOR for top in whole.choices[0].logprobs.top_logprobs for v in top.values()
    )


def _nested(depth: int, leaf: object) -> object:
    """`leaf` at `depth` levels of lists (its path has `depth` parts)."""
    for _ in range(depth):
        leaf = [leaf]
    return leaf


@pytest.mark.parametrize("leaf", [7, "text", [], {}])
def test_the_depth_limit_counts_every_value_alike(leaf):
    """A value whose path has MAX_JSON_DEPTH parts is refused, a scalar as much as a container;
    one part fewer passes."""
    check_json_values(_nested(MAX_JSON_DEPTH - 1, leaf))
    with pytest.raises(APIError, match="nested deeper"):
        check_json_values(_nested(MAX_JSON_DEPTH, leaf))


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": [1, 2, 2**63]}, "prompt.2"),
        ({"prompt": [1, -(2**63) - 1]}, "prompt.1"),
        ({"a": {"b": [0.5, math.inf]}}, "a.b.1"),
        ({"messages": [{"content": "ok"}, {"content": "bad \ud800"}]}, "messages.1.content"),
        ({"x\udfff": 1}, None),
        ("\ud800", None),
    ],
)
def test_each_bad_value_is_named_by_its_path(body, param):
    with pytest.raises(APIError) as caught:
        check_json_values(body)
    assert caught.value.param == param


def test_good_values_pass():
    check_json_values(
        {"prompt": [0, 2**63 - 1, -(2**63)], "t": 0.5, "s": "é", "b": True, "n": None, "e": {}}
    )
