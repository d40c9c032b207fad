"""SSE frames: what every streamed chunk is wrapped in."""

from __future__ import annotations

import json

import pytest

from metrale.server import sse


def _strict(text: str):
    """JSON as a browser's `JSON.parse` reads it: no NaN or Infinity."""

    def refuse(name: str):
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_a_frame_is_one_compact_json_data_line():
    payload = {"id": "x", "choices": [{"text": "héllo \n😀", "logprobs": None, "index": 0}]}
    frame = sse.event(payload)
    assert frame.startswith(b"data: ") and frame.endswith(b"\n\n") and frame.count(b"\n") == 2
    assert _strict(frame[6:-2].decode()) == payload
    assert "héllo".encode() in frame  # UTF-8, not \\u escapes


def test_a_named_frame_carries_its_event_line():
    frame = sse.event({"type": "ping"}, "ping")
    assert frame == b'event: ping\ndata: {"type":"ping"}\n\n'


@pytest.mark.parametrize("value", [float("-inf"), float("inf"), float("nan")])
def test_numbers_json_lacks_become_null_not_invalid_json(value):
    frame = sse.event({"logprob": value, "top": {"a": value}})
    assert _strict(frame[6:-2].decode()) == {"logprob": None, "top": {"a": None}}


def test_what_msgspec_cannot_encode_is_still_framed():
    huge = 2**70  # past 64 bits
    frame = sse.event({"seed": huge})
    assert json.loads(frame[6:-2]) == {"seed": huge}
