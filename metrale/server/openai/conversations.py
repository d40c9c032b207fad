"""`/v1/conversations`: OpenAI's conversation objects, which hold items for the Responses API.

A conversation is created with up to 20 items and metadata; a response given `conversation`
reads its items as the prompt's history and, once it completes, appends its input and output
(`responses/routes.py`). Items can be listed (newest first by default), fetched, added and
deleted here. Everything lives in the server's record store (`--response-store`).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from pydantic import Field

from metrale.server.errors import parse_body
from metrale.server.json_body import JSONResponse
from metrale.server.openai.pages import item_page, page_body
from metrale.server.openai.responses import records
from metrale.server.openai.responses.protocol import MAX_METADATA_KEYS, InputItem
from metrale.server.openai.responses.translate import chat_messages, tool_set
from metrale.server.protocol import _Body
from metrale.server.state import ServerState

router = APIRouter()
MAX_ITEMS_PER_CALL = 20  # OpenAI's limit on the items one call may add
Metadata = Annotated[dict[str, str], Field(max_length=MAX_METADATA_KEYS)]


class CreateConversation(_Body):
    items: Annotated[list[InputItem], Field(max_length=MAX_ITEMS_PER_CALL)] | None = None
    metadata: Metadata | None = None


class UpdateConversation(_Body):
    metadata: Metadata


class AddItems(_Body):
    items: Annotated[list[InputItem], Field(min_length=1, max_length=MAX_ITEMS_PER_CALL)]


def _checked_items(items: list[Any]) -> list[dict[str, Any]]:
    """Items as stored, refused now if a prompt could not be made of them later."""
    chat_messages(items, tool_set(None))
    return records.item_dicts(items)


@router.post("/v1/conversations")
async def create_conversation(request: Request) -> Any:
    state: ServerState = request.app.state.server
    body = await parse_body(request, CreateConversation)
    conversation = {
        "id": f"conv_{uuid.uuid4().hex}",
        "object": "conversation",
        "created_at": int(time.time()),
        "metadata": body.metadata or {},
    }
    record = {"conversation": conversation, "items": _checked_items(body.items or [])}
    records.save_conversation(state.store, record)
    return JSONResponse(conversation)


@router.get("/v1/conversations/{conversation_id}")
async def get_conversation(request: Request, conversation_id: str) -> Any:
    state: ServerState = request.app.state.server
    record = records.conversation_record(state.store, conversation_id, "conversation_id")
    return JSONResponse(record["conversation"])


@router.post("/v1/conversations/{conversation_id}")
async def update_conversation(request: Request, conversation_id: str) -> Any:
    state: ServerState = request.app.state.server
    body = await parse_body(request, UpdateConversation)
    record = records.conversation_record(state.store, conversation_id, "conversation_id")
    record["conversation"]["metadata"] = body.metadata
    records.save_conversation(state.store, record)
    return JSONResponse(record["conversation"])


@router.delete("/v1/conversations/{conversation_id}")
async def delete_conversation(request: Request, conversation_id: str) -> Any:
    state: ServerState = request.app.state.server
    records.conversation_record(state.store, conversation_id, "conversation_id")
    state.store.delete(records.CONVERSATION, conversation_id)
    return JSONResponse({"id": conversation_id, "object": "conversation.deleted", "deleted": True})


@router.get("/v1/conversations/{conversation_id}/items")
async def list_items(
    request: Request,
    conversation_id: str,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Literal["asc", "desc"] = "desc",
) -> Any:
    state: ServerState = request.app.state.server
    record = records.conversation_record(state.store, conversation_id, "conversation_id")
    return JSONResponse(item_page(record["items"], after=after, limit=limit, order=order))


@router.post("/v1/conversations/{conversation_id}/items")
async def add_items(request: Request, conversation_id: str) -> Any:
    state: ServerState = request.app.state.server
    body = await parse_body(request, AddItems)
    record = records.conversation_record(state.store, conversation_id, "conversation_id")
    added = _checked_items(body.items)
    record["items"] += added
    records.save_conversation(state.store, record)
    return JSONResponse(page_body(added, False))


@router.get("/v1/conversations/{conversation_id}/items/{item_id}")
async def get_item(request: Request, conversation_id: str, item_id: str) -> Any:
    state: ServerState = request.app.state.server
    record = records.conversation_record(state.store, conversation_id, "conversation_id")
    item = next((item for item in record["items"] if item["id"] == item_id), None)
    if item is None:
        raise records.not_found("item in this conversation", item_id, "item_id")
    return JSONResponse(item)


@router.delete("/v1/conversations/{conversation_id}/items/{item_id}")
async def delete_item(request: Request, conversation_id: str, item_id: str) -> Any:
    state: ServerState = request.app.state.server
    record = records.conversation_record(state.store, conversation_id, "conversation_id")
    kept = [item for item in record["items"] if item["id"] != item_id]
    if len(kept) == len(record["items"]):
        raise records.not_found("item in this conversation", item_id, "item_id")
    record["items"] = kept
    records.save_conversation(state.store, record)
    return JSONResponse(record["conversation"])
