"""The ASGI middleware every HTTP request crosses before routing, and the last-resort handler.

In order: a request id (the client's `x-request-id` when it is a plain token, else a new one,
echoed in the response), the body-size limit (`Content-Length` first, then the bytes as they
arrive), the API key (before routing, so unknown paths under `/v1/` are 401 too), and the
requests-per-minute bucket. Every refusal is in the route's error shape (OpenAI's, or
Anthropic's on `/v1/messages*`).

Anything a route raises that no handler turned into an answer ends here: logged with the request
id, and answered as a 500 in the route's shape if the response has not begun; a stream that has
begun gets an error event in its API's framing and a clean end. The connection is never reset.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import uuid
from collections.abc import Callable
from typing import Any

from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from metrale.server import access_log, sse
from metrale.server.anthropic.errors import is_anthropic_path, note_error, shaped
from metrale.server.errors import APIError
from metrale.server.security.api_keys import presented_keys
from metrale.server.security.guard import (
    CLIENT_SCOPE_KEY,
    Guard,
    authentication_error,
    body_too_large_error,
    rate_limit_error,
)

logger = logging.getLogger(__name__)

REQUEST_ID_HEADER = b"x-request-id"
_CLIENT_REQUEST_ID = re.compile(rb"[A-Za-z0-9._:\-]{1,128}")


class BodyTooLarge(Exception):
    """Raised from `receive` once a body passes the limit; answered 413 here."""


class EdgeMiddleware:
    def __init__(self, app: ASGIApp, guard: Guard) -> None:
        self.app = app
        self.guard = guard

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or ())
        given_id = headers.get(REQUEST_ID_HEADER, b"")
        request_id = (
            given_id.decode()
            if _CLIENT_REQUEST_ID.fullmatch(given_id)
            else f"req_{uuid.uuid4().hex}"
        )
        scope.setdefault("state", {})["request_id"] = request_id
        exchange = _Exchange(scope, send, request_id)
        try:
            refusal = self._check(scope, headers)
            if (client := scope["state"].get(CLIENT_SCOPE_KEY)) is not None:
                # sent with the response, so they count what the route charged
                exchange.late_headers = lambda: self.guard.limiter.headers(client)
            if refusal is not None:
                await exchange.answer(refusal)
                return
            await self.app(scope, self._limited(receive), exchange.send)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            await self._last_resort(scope, exchange, e)

    def _check(self, scope: Scope, headers: dict[bytes, bytes]) -> APIError | None:
        """A refusal for this request before it reaches a route, or None to let it through."""
        guard, path = self.guard, scope["path"]
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > guard.config.max_request_bytes:
            return body_too_large_error(guard.config.max_request_bytes)
        client = None
        if guard.keys.guards(path):
            for key in presented_keys(headers, anthropic=is_anthropic_path(path)):
                client = client or guard.keys.identify(key)
            if client is None:
                return authentication_error()
            if (record := access_log.current_record()) is not None:
                record.tenant = client
        limiter = guard.limiter
        if not limiter.enabled or not path.startswith("/v1/"):
            return None
        if client is None:
            address = scope.get("client")
            client = f"addr:{address[0] if address else 'unknown'}"
        scope["state"][CLIENT_SCOPE_KEY] = client
        if scope["method"] == "POST" and (refusal := limiter.charge_request(client)) is not None:
            return rate_limit_error(refusal, limiter.headers(client))
        return None

    def _limited(self, receive: Receive) -> Receive:
        limit, received = self.guard.config.max_request_bytes, 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge
            return message

        return limited_receive

    async def _last_resort(self, scope: Scope, exchange: _Exchange, e: Exception) -> None:
        if _contains(e, BodyTooLarge):
            await exchange.answer(body_too_large_error(self.guard.config.max_request_bytes))
            return
        if _contains(e, ClientDisconnect):
            return  # nobody to answer
        logger.error(
            "request %s: unhandled error on %s %s",
            exchange.request_id,
            scope.get("method"),
            scope.get("path"),
            exc_info=e,
        )
        error = APIError(
            f"internal error ({type(e).__name__}); the server logged it under request id "
            f"{exchange.request_id}",
            500,
        )
        await exchange.answer(error)


def _contains(e: BaseException, kind: type[BaseException]) -> bool:
    if isinstance(e, kind):
        return True
    if isinstance(e, BaseExceptionGroup):
        return any(_contains(inner, kind) for inner in e.exceptions)
    return False


class _Exchange:
    """The response side of one request: what has been sent, so that an error at any point
    still ends it in the API's shape."""

    def __init__(self, scope: Scope, send: Send, request_id: str) -> None:
        self.scope = scope
        self.path = scope["path"]
        self._send = send
        self.request_id = request_id
        self.started = False
        self.finished = False
        self.event_stream = False
        self.late_headers: Callable[[], list[tuple[str, str]]] = list

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            headers = list(message.get("headers") or ())
            self.event_stream = any(
                k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                for k, v in headers
            )
            names = {k.lower() for k, _ in headers}
            headers.append((REQUEST_ID_HEADER, self.request_id.encode()))
            headers += [
                (k.encode(), v.encode()) for k, v in self.late_headers() if k.encode() not in names
            ]
            message = {**message, "headers": headers}
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.finished = True
        await self._send(message)

    async def answer(self, error: APIError) -> None:
        """Send `error` in the route's shape: a whole response, or the end of one begun."""
        note_error(self.scope, error)
        status, body = shaped(self.path, error)
        try:
            if not self.started:
                await self.send(
                    {
                        "type": "http.response.start",
                        "status": status,
                        "headers": [
                            (b"content-type", b"application/json"),
                            *((k.encode(), v.encode()) for k, v in error.headers.items()),
                        ],
                    }
                )
                await self.send({"type": "http.response.body", "body": _json(body)})
            elif not self.finished:
                tail = _stream_error(self.path, body) if self.event_stream else b""
                await self.send({"type": "http.response.body", "body": tail})
        except Exception:  # the client is gone: nothing more to do
            logger.debug("request %s: could not send the error", self.request_id, exc_info=True)


def _json(body: dict[str, Any]) -> bytes:
    # ASCII, so that no text in an error can fail to encode.
    return json.dumps(body, ensure_ascii=True).encode()


def _stream_error(path: str, body: dict[str, Any]) -> bytes:
    if is_anthropic_path(path):
        return b"event: error\ndata: " + _json(body) + b"\n\n"
    return b"data: " + _json(body) + b"\n\n" + sse.DONE
