"""Server-sent events framing.

Frames are bytes, encoded by msgspec (a tenth of `json.dumps`'s time a chunk, on the path
every streamed token takes). Where JSON has no number (NaN, infinities) msgspec writes null,
not `json.dumps`'s `NaN` / `-Infinity`, which JavaScript's `JSON.parse` rejects. A payload
msgspec cannot encode (an integer past 64 bits) falls back to the standard library.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

DONE = b"data: [DONE]\n\n"

_encode = msgspec.json.Encoder().encode


def event(payload: dict[str, Any], name: str | None = None) -> bytes:
    """One `data:` frame of `payload` as JSON; named (an `event:` line) when `name` is given."""
    try:
        data = _encode(payload)
    except (TypeError, OverflowError):
        data = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()
    frame = b"data: " + data + b"\n\n"
    return frame if name is None else b"event: " + name.encode() + b"\n" + frame
