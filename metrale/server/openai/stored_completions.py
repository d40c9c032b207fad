"""Stored chat completions: `store: true` on `/v1/chat/completions` keeps the completion and
its request's messages in the server's record store (`--response-store`, shared with the
Responses API), and these routes list, fetch, update and delete them, as OpenAI's API has.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from pydantic import Field

from metrale.server.errors import APIError, parse_body
from metrale.server.json_body import JSONResponse
from metrale.server.openai.pages import item_page, page_body
from metrale.server.protocol import ChatMessage, _Body
from metrale.server.state import ServerState

logger = logging.getLogger(__name__)
router = APIRouter()
KIND = "chat.completion"


class UpdateCompletion(_Body):
    metadata: Annotated[dict[str, str], Field(max_length=16)]


def store_completion(
    state: ServerState, completion: dict[str, Any], messages: list[ChatMessage]
) -> None:
    """Keep a finished completion; one too big for the store is not kept (the reply is sent
    all the same) and the log says so."""
    stored_messages = [
        {"id": f"{completion['id']}-{i}", **m.model_dump(exclude_none=True)}
        for i, m in enumerate(messages)
    ]
    try:
        state.store.put(
            KIND, completion["id"], {"completion": completion, "messages": stored_messages}
        )
    except ValueError as e:
        logger.warning("chat completion %s not stored: %s", completion["id"], e)


def _record(state: ServerState, completion_id: str) -> dict[str, Any]:
    record = state.store.get(KIND, completion_id)
    if record is None:
        raise APIError(
            f"no stored chat completion with id {completion_id!r} (only completions "
            f"created with store: true are kept)",
            404,
            param="completion_id",
        )
    return record


@router.get("/v1/chat/completions")
async def list_completions(
    request: Request,
    model: str | None = None,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Literal["asc", "desc"] = "asc",
) -> Any:
    state: ServerState = request.app.state.server
    # metadata[key]=value filters, as OpenAI's list takes them.
    wanted = {
        key[len("metadata[") : -1]: value
        for key, value in request.query_params.items()
        if key.startswith("metadata[") and key.endswith("]")
    }

    def match(record: dict[str, Any]) -> bool:
        completion = record["completion"]
        metadata = completion.get("metadata") or {}
        return (model is None or completion["model"] == model) and all(
            metadata.get(k) == v for k, v in wanted.items()
        )

    try:
        page = state.store.list(KIND, limit=limit, after=after, order=order, match=match)
    except KeyError:
        raise APIError(f"after: no stored chat completion {after!r}", 400, param="after") from None
    return JSONResponse(page_body([r["completion"] for r in page.records], page.has_more))


@router.get("/v1/chat/completions/{completion_id}")
async def get_completion(request: Request, completion_id: str) -> Any:
    state: ServerState = request.app.state.server
    return JSONResponse(_record(state, completion_id)["completion"])


@router.post("/v1/chat/completions/{completion_id}")
async def update_completion(request: Request, completion_id: str) -> Any:
    state: ServerState = request.app.state.server
    body = await parse_body(request, UpdateCompletion)
    record = _record(state, completion_id)
    record["completion"]["metadata"] = body.metadata
    state.store.put(KIND, completion_id, record)
    return JSONResponse(record["completion"])


@router.delete("/v1/chat/completions/{completion_id}")
async def delete_completion(request: Request, completion_id: str) -> Any:
    state: ServerState = request.app.state.server
    _record(state, completion_id)
    state.store.delete(KIND, completion_id)
    return JSONResponse({"id": completion_id, "object": "chat.completion.deleted", "deleted": True})


@router.get("/v1/chat/completions/{completion_id}/messages")
async def list_messages(
    request: Request,
    completion_id: str,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Literal["asc", "desc"] = "asc",
) -> Any:
    state: ServerState = request.app.state.server
    messages = _record(state, completion_id)["messages"]
    return JSONResponse(item_page(messages, after=after, limit=limit, order=order))
