"""`/v1/models`, `/tokenize`, `/detokenize`, and the OpenAI endpoints we do not serve."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from metrale.server.chat_request import render_messages
from metrale.server.errors import APIError, model_not_found, parse_body
from metrale.server.generation import check_token_ids
from metrale.server.protocol import DetokenizeRequest, TokenizeRequest
from metrale.server.state import ServerState
from metrale.tokenizer import ChatTemplateError

router = APIRouter()

UNSERVED = {
    "/v1/embeddings": "embeddings",
    "/v1/files": "files",
    "/v1/files/{path:path}": "files",
    "/v1/audio/{path:path}": "audio",
    "/v1/images/{path:path}": "images",
    "/v1/moderations": "moderations",
    "/v1/batches": "batches",
    "/v1/batches/{path:path}": "batches",
}


def _model_card(state: ServerState) -> dict[str, Any]:
    return {
        "id": state.settings.served_model_name,
        "object": "model",
        "created": int(state.started_at_s),
        "owned_by": "metrale",
        "max_model_len": state.config.scheduler.max_seq_len,
    }


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [_model_card(request.app.state.server)]}


@router.get("/v1/models/{model_id:path}")
async def get_model(request: Request, model_id: str) -> dict[str, Any]:
    state: ServerState = request.app.state.server
    if model_id != state.settings.served_model_name:
        raise model_not_found(model_id)
    return _model_card(state)


@router.post("/tokenize")
async def tokenize(request: Request) -> dict[str, Any]:
    state: ServerState = request.app.state.server
    body = await parse_body(request, TokenizeRequest)
    state.check_model(body.model)
    if body.messages is not None:
        try:
            text = state.tokenizer.apply_chat_template(
                render_messages(body.messages),
                add_generation_prompt=body.add_generation_prompt,
                **(body.chat_template_kwargs or {}),
            )
        except ChatTemplateError as e:
            raise APIError(
                f"the chat template could not render these messages: {e}", param="messages"
            ) from None
        tokens = state.tokenizer.encode(text, add_special_tokens=False)
    else:
        tokens = state.tokenizer.encode(
            body.prompt or "", add_special_tokens=body.add_special_tokens
        )
    return {
        "tokens": tokens,
        "count": len(tokens),
        "max_model_len": state.config.scheduler.max_seq_len,
    }


@router.post("/detokenize")
async def detokenize(request: Request) -> dict[str, Any]:
    state: ServerState = request.app.state.server
    body = await parse_body(request, DetokenizeRequest)
    state.check_model(body.model)
    check_token_ids(body.tokens, state.tokenizer.vocab_size, "tokens")
    return {"prompt": state.tokenizer.decode(body.tokens, skip_special_tokens=False)}


def _unserved(name: str):
    async def handler(request: Request) -> None:
        raise APIError(
            f"{request.url.path}: the {name} API is not supported by this server (Metrale "
            f"serves chat completions, completions and messages)",
            501,
            code="unsupported_endpoint",
        )

    return handler


for _path, _name in UNSERVED.items():
    router.add_api_route(
        _path, _unserved(_name), methods=["GET", "POST", "DELETE"], include_in_schema=False
    )
