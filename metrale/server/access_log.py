"""One access-log line per HTTP request, and `metrale:http_requests_total{route,status}`.

`AccessLogMiddleware` is the outermost ASGI layer: it sees the final status of everything,
the edge's refusals included, and a stream only once its last byte is sent. The routes that
generate fill in the request's `RequestRecord` (tokens, first-token time, finish reason)
through `current_record()`, a context variable the middleware sets for the request's task and
the tasks it starts; the request id is the one the edge gave it (`x-request-id`).
"""

from __future__ import annotations

import contextvars
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from metrale.frontend.output_processor import CompletionDelta
from metrale.server.anthropic.errors import ERROR_SCOPE_KEY
from metrale.telemetry.metrics import REJECTION_REASONS, Metrics

logger = logging.getLogger("metrale.access")

COMPACTED_HEADER = b"x-metrale-compacted"  # on a response whose prompt --auto-compact shortened

_APIS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/messages": "messages",
    "/v1/responses": "responses",
}
_current: contextvars.ContextVar[RequestRecord | None] = contextvars.ContextVar(
    "metrale_request_record", default=None
)


def current_record() -> RequestRecord | None:
    """The record of the HTTP request being served, if any (the offline LLM has none)."""
    return _current.get()


@dataclass
class RequestRecord:
    method: str
    path: str
    start_s: float
    request_id: str = ""
    status: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    first_token_s: float | None = None
    finish_reasons: dict[str, int] = field(default_factory=dict)  # per choice
    compaction: Any = None  # the server.compaction.Compaction of its prompt, if compacted
    tenant: str | None = None  # the client its API key identified (None: no keys, or none)

    @property
    def api(self) -> str:
        return _APIS.get(self.path, self.path)

    def add_prompt(self, num_tokens: int) -> None:
        self.prompt_tokens += num_tokens

    def add(self, delta: CompletionDelta) -> None:
        if delta.token_ids and self.first_token_s is None:
            self.first_token_s = time.monotonic()
        self.generated_tokens += len(delta.token_ids)
        if delta.finish_reason is not None:
            self.cached_tokens += delta.num_cached_tokens
            self.finish_reasons[delta.finish_reason] = (
                self.finish_reasons.get(delta.finish_reason, 0) + 1
            )

    def fields(self, route: str, error: tuple[str | None, str] | None) -> dict[str, Any]:
        now = time.monotonic()
        reasons = ",".join(sorted(self.finish_reasons)) or None
        return {
            "request_id": self.request_id,
            "method": self.method,
            "path": self.path,
            "route": route,
            "status": self.status,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "generated_tokens": self.generated_tokens,
            "ttft_s": None if self.first_token_s is None else self.first_token_s - self.start_s,
            "total_s": now - self.start_s,
            "finish_reason": reasons,
            "error": None if error is None else error[0] or error[1],
        }


class AccessLogMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        metrics: Metrics | None,
        routes: Sequence[BaseRoute] = (),
        enabled: bool = True,
    ) -> None:
        self.app = app
        self.metrics = metrics
        self.routes = routes
        self.enabled = enabled

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        record = RequestRecord(scope["method"], scope["path"], time.monotonic())
        scope.setdefault("state", {})

        async def recording_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
                if record.compaction is not None:  # the prompt was shortened: say how
                    steps = ",".join(record.compaction.steps).encode()
                    message["headers"] = [*message.get("headers", []), (COMPACTED_HEADER, steps)]
            await send(message)

        token = _current.set(record)
        try:
            await self.app(scope, receive, recording_send)
        finally:
            _current.reset(token)
            self._finish(scope, record)

    def _finish(self, scope: Scope, record: RequestRecord) -> None:
        state = scope.get("state", {})
        record.request_id = state.get("request_id", "")
        route = self._route(scope)
        error = state.get(ERROR_SCOPE_KEY)
        if record.status == 0:  # the client left before any answer
            record.status = 499
        if (metrics := self.metrics) is not None:
            metrics.child(metrics.http_requests, route, str(record.status)).inc()
            if error is not None and (reason := rejection_reason(*error)) is not None:
                metrics.child(metrics.rejected_requests, reason).inc()
        if self.enabled and logger.isEnabledFor(logging.INFO):
            fields = record.fields(route, error)
            logger.info(_line(fields), extra={"access": fields})

    def _route(self, scope: Scope) -> str:
        """The route's template (`/v1/models/{model_id}`), so labels stay few; a path no route
        serves is `unmatched`."""
        route = scope.get("route")
        if route is None:  # refused before routing (401, 413, 429): route it here
            for candidate in self.routes:
                match, child = candidate.matches(scope)
                if match is Match.FULL:
                    route = child.get("route", candidate)
                    break
        path = getattr(route, "path", None)
        return path if isinstance(path, str) else "unmatched"


def rejection_reason(code: str | None, error_type: str) -> str | None:
    """Which `metrale:rejected_requests_total` reason an error answer counts under, if any."""
    if code == "rate_limit_exceeded":
        return error_type  # requests or tokens
    return code if code in REJECTION_REASONS else None


def _line(f: dict[str, Any]) -> str:
    def seconds(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}s"

    line = (
        f"{f['request_id']} {f['method']} {f['path']} {f['status']} "
        f"prompt={f['prompt_tokens']} cached={f['cached_tokens']} "
        f"generated={f['generated_tokens']} ttft={seconds(f['ttft_s'])} "
        f"total={seconds(f['total_s'])} finish={f['finish_reason'] or '-'}"
    )
    return line if f["error"] is None else f"{line} error={f['error']}"
