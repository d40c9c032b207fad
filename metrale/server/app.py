"""The FastAPI application: routers, and error handlers that keep every error in API shape."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from metrale.server import ops
from metrale.server.errors import APIError, http_status_error
from metrale.server.openai import chat, completions, models
from metrale.server.state import ServerState

logger = logging.getLogger(__name__)


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="Metrale", version="0.1.0", docs_url=None, redoc_url=None)
    app.state.server = state
    for router in (chat.router, completions.router, models.router, ops.router):
        app.include_router(router)

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def request_validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {"loc": (), "msg": "invalid request"}
        param = ".".join(str(p) for p in first.get("loc", ()))
        return APIError(f"{param}: {first.get('msg')}", 400, param=param or None).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        detail = e.detail if isinstance(e.detail, str) else None
        return http_status_error(e.status_code, detail).response()

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, e: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return APIError(f"internal error: {type(e).__name__}", 500).response()

    return app
