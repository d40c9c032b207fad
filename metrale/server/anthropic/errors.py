"""Errors in Anthropic's shape on the Anthropic routes, OpenAI's everywhere else.

The shared machinery (body parsing, model and engine checks, prompt validation) raises
`APIError`s with an HTTP status. On `/v1/messages*` the status picks the error type from
Anthropic's documented table and the body becomes `{"type": "error", "error": {"type",
"message"}}`, the shape the Anthropic SDKs read; the status itself is kept.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request

from metrale.server.errors import APIError
from metrale.server.json_body import JSONResponse

ROUTE_PREFIX = "/v1/messages"
# Where the error a request was answered with is left for the access log (in the scope state).
ERROR_SCOPE_KEY = "metrale_error"

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}


def is_anthropic_path(path: str) -> bool:
    return path == ROUTE_PREFIX or path.startswith(ROUTE_PREFIX + "/")


def error_type(status: int) -> str:
    # Anthropic uses invalid_request_error for 4xx statuses its table does not list, and
    # api_error is its "unexpected internal error": a dead engine is one (status 503).
    return _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def error_body(e: APIError) -> dict[str, Any]:
    status = e.anthropic_status
    return {"type": "error", "error": {"type": error_type(status), "message": e.message}}


def shaped(path: str, e: APIError) -> tuple[int, dict[str, Any]]:
    """`e` as the client of `path` reads errors: (status, body)."""
    if is_anthropic_path(path):
        return e.anthropic_status, error_body(e)
    return e.status, e.body()


def shaped_response(request: Request, e: APIError) -> JSONResponse:
    note_error(request.scope, e)
    status, body = shaped(request.url.path, e)
    return JSONResponse(body, status_code=status, headers=e.headers)


def note_error(scope: dict[str, Any], e: APIError) -> None:
    """Leave `e`'s code and type in the request's scope, for the access log and the metrics."""
    scope.setdefault("state", {})[ERROR_SCOPE_KEY] = (e.code, e.error_type)
