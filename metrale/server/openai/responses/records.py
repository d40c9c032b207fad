"""What the Responses API keeps in the server's record store: responses (with their input
items) and conversations (their items, in order).

A stored response is `{"response": <the response object>, "input": [<its input items>]}`; the
conversation it continues is found by walking `previous_response_id` back, each response's input
then its output, so a long session stores every item once. A conversation is
`{"conversation": <the object>, "items": [...]}`. Items get ids as they are stored (`msg_...`
and the like for input items that came without one), so they can be listed and fetched.
"""

from __future__ import annotations

import uuid
from typing import Any

import pydantic

from metrale.server.errors import APIError
from metrale.server.openai.responses.protocol import InputItem
from metrale.server.stores import RecordStore

RESPONSE = "response"
CONVERSATION = "conversation"
MAX_CHAIN = 10_000  # responses walked back through previous_response_id
ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}

_items_adapter = pydantic.TypeAdapter(list[InputItem])


def not_found(kind: str, key: str, param: str) -> APIError:
    return APIError(
        f"no {kind} with id {key!r} (it was never stored, was deleted or expired)",
        404,
        param=param,
        code="not_found",
        error_type="invalid_request_error",
    )


def item_dicts(items: list[Any]) -> list[dict[str, Any]]:
    """Input items as stored: the dicts the client sent, each with an id."""
    out = []
    for item in items:
        data = item.model_dump(exclude_none=True, by_alias=True)
        data.setdefault("type", "message")
        if data["type"] == "message" and isinstance(data["content"], str):
            # Stored as OpenAI lists them: content as parts, whatever shape it came in.
            kind = "output_text" if data["role"] == "assistant" else "input_text"
            data["content"] = [{"type": kind, "text": data["content"]}]
        if not data.get("id"):
            data["id"] = f"{ID_PREFIXES.get(data['type'], 'item')}_{uuid.uuid4().hex}"
        out.append(data)
    return out


def parsed_items(items: list[dict[str, Any]]) -> list[Any]:
    """Stored items (inputs, or a response's output) as input items for the next prompt."""
    try:
        return _items_adapter.validate_python(items)
    except pydantic.ValidationError as e:  # a record written by another version
        raise APIError(f"a stored item cannot be read back: {e.errors()[0]['msg']}", 500) from e


def response_record(store: RecordStore, response_id: str, param: str = "response_id") -> dict:
    record = store.get(RESPONSE, response_id)
    if record is None:
        raise not_found("response", response_id, param)
    return record


def history(store: RecordStore, previous_response_id: str) -> list[dict[str, Any]]:
    """Every item of the conversation up to and including `previous_response_id`'s output."""
    chain = []
    key: str | None = previous_response_id
    while key is not None and len(chain) < MAX_CHAIN:
        param = "previous_response_id"
        record = response_record(store, key, param) if not chain else store.get(RESPONSE, key)
        if record is None:
            raise APIError(
                f"previous_response_id {previous_response_id!r}: an earlier response of this "
                f"conversation ({key!r}) is no longer stored, so the conversation cannot be "
                f"continued; send the whole input instead",
                400,
                param=param,
            )
        chain.append(record)
        key = record["response"].get("previous_response_id")
    items: list[dict[str, Any]] = []
    for record in reversed(chain):
        items += record["input"] + record["response"]["output"]
    return items


def save_response(
    store: RecordStore, response: dict[str, Any], input_items: list[dict[str, Any]]
) -> None:
    try:
        store.put(RESPONSE, response["id"], {"response": response, "input": input_items})
    except ValueError as e:  # bigger than the whole store may hold
        raise APIError(f"the response cannot be stored: {e}; send store: false", 400) from None


def conversation_record(store: RecordStore, conversation_id: str, param: str) -> dict[str, Any]:
    record = store.get(CONVERSATION, conversation_id)
    if record is None:
        raise not_found("conversation", conversation_id, param)
    return record


def save_conversation(store: RecordStore, record: dict[str, Any]) -> None:
    try:
        store.put(CONVERSATION, record["conversation"]["id"], record)
    except ValueError as e:
        raise APIError(f"the conversation cannot hold more: {e}", 400) from None
