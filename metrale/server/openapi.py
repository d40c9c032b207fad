"""The request bodies in the app's OpenAPI document (`/openapi.json`).

The routes parse their bodies themselves (`errors.parse_body`, so that every failure is in the
API's own error shape), which leaves FastAPI nothing to describe. Here the same pydantic models
are written into the document, so clients, code generators and schema-driven fuzzers
(schemathesis, in the tests) see what each route takes.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from metrale.server.anthropic.protocol import CountTokensRequest, MessagesRequest
from metrale.server.openai.conversations import AddItems, CreateConversation
from metrale.server.openai.responses.protocol import ResponsesRequest
from metrale.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)

REQUEST_BODIES: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/v1/messages": MessagesRequest,
    "/v1/messages/count_tokens": CountTokensRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
    "/v1/responses": ResponsesRequest,
    "/v1/conversations": CreateConversation,
    "/v1/conversations/{conversation_id}/items": AddItems,
}


def describe_request_bodies(app: FastAPI) -> None:
    """Make `app.openapi()` include each POST route's body schema."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _document(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _document(app: FastAPI) -> dict[str, Any]:
    document = get_openapi(title=app.title, version=app.version, routes=app.routes)
    models = list(dict.fromkeys(REQUEST_BODIES.values()))
    _, definitions = models_json_schema(
        [(model, "validation") for model in models], ref_template="#/components/schemas/{model}"
    )
    document.setdefault("components", {}).setdefault("schemas", {}).update(
        definitions.get("$defs", {})
    )
    for path, model in REQUEST_BODIES.items():
        operation = document["paths"][path]["post"]
        operation["requestBody"] = {
            "required": True,
            "content": {
                "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}
            },
        }
    return document
