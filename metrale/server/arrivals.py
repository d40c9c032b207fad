"""Counts each generating request from the moment the server starts reading it until it reaches
the engine (`frontend/arrivals.py`), so the output router lets a burst of requests in first."""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from metrale.frontend.arrivals import Arrivals

# The routes that add engine requests (POST).
GENERATING_PATHS = frozenset(
    {"/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses"}
)


class ArrivalsMiddleware:
    def __init__(self, app: ASGIApp, arrivals: Arrivals) -> None:
        self.app = app
        self.arrivals = arrivals

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["method"] != "POST"
            or scope["path"] not in GENERATING_PATHS
        ):
            await self.app(scope, receive, send)
            return
        with self.arrivals.arriving():
            await self.app(scope, receive, send)
