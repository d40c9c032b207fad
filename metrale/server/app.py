"""The FastAPI application: routers, the edge middleware, and error handlers that keep every
error in API shape."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from metrale.server import observe, ops
from metrale.server.access_log import AccessLogMiddleware
from metrale.server.anthropic import messages as anthropic_messages
from metrale.server.anthropic.errors import shaped_response
from metrale.server.errors import APIError, http_status_error
from metrale.server.json_body import JSONResponse
from metrale.server.openai import chat, completions, conversations, models, stored_completions
from metrale.server.openai.responses import routes as responses
from metrale.server.openapi import describe_request_bodies
from metrale.server.security.middleware import EdgeMiddleware
from metrale.server.state import ServerState


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(
        title="Metrale",
        version="0.1.0",
        docs_url=None,
        redoc_url=None,
        default_response_class=JSONResponse,
    )
    app.state.server = state
    routers = (
        chat.router,
        stored_completions.router,
        completions.router,
        models.router,
        responses.router,
        conversations.router,
        ops.router,
        observe.router,
        anthropic_messages.router,
    )
    for router in routers:
        app.include_router(router)
    describe_request_bodies(app)

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return shaped_response(request, e)

    @app.exception_handler(RequestValidationError)
    async def request_validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {"loc": (), "msg": "invalid request"}
        param = ".".join(str(p) for p in first.get("loc", ()))
        error = APIError(f"{param}: {first.get('msg')}", 400, param=param or None)
        return shaped_response(request, error)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        detail = e.detail if isinstance(e.detail, str) else None
        return shaped_response(request, http_status_error(e.status_code, detail))

    # Keys, limits and the last-resort handler (anything unexpected: a 500 in the route's
    # shape, logged with the request id) wrap every route.
    app.add_middleware(EdgeMiddleware, guard=state.guard)
    # Outermost: it sees every answer's final status, the edge's refusals too.
    app.add_middleware(
        AccessLogMiddleware,
        metrics=state.llm.telemetry.metrics,
        routes=[route for router in routers for route in router.routes],
        enabled=state.settings.access_log,
    )
    return app
