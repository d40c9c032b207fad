"""Server-sent events framing: byte frames of `json_body.dumps`'s JSON."""

from __future__ import annotations

from typing import Any

from metrale.server.json_body import dumps

DONE = b"data: [DONE]\n\n"


def event(payload: dict[str, Any], name: str | None = None) -> bytes:
    """One `data:` frame of `payload` as JSON; named (an `event:` line) when `name` is given."""
    frame = b"data: " + dumps(payload) + b"\n\n"
    return frame if name is None else b"event: " + name.encode() + b"\n" + frame
