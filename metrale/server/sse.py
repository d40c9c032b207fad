"""Server-sent events framing."""

from __future__ import annotations

import json
from typing import Any

DONE = "data: [DONE]\n\n"


def event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"
