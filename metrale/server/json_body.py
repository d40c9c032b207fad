"""JSON bodies, as every response and stream frame writes them.

msgspec encodes them (a tenth of `json.dumps`'s time). Where JSON has no number (NaN,
infinities), it writes null; `json.dumps` would write `NaN` / `-Infinity`, which JavaScript's
`JSON.parse` rejects, and starlette's own JSONResponse raises on them (a 500). Whatever a model
produces, the response stays JSON. A payload msgspec cannot encode (an integer past 64 bits)
falls back to the standard library.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
from starlette.responses import JSONResponse as StarletteJSONResponse

_encode = msgspec.json.Encoder().encode


def dumps(payload: Any) -> bytes:
    try:
        return _encode(payload)
    except (TypeError, OverflowError):
        return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()


class JSONResponse(StarletteJSONResponse):
    """starlette's JSONResponse, encoded by `dumps`."""

    def render(self, content: Any) -> bytes:
        return dumps(content)
