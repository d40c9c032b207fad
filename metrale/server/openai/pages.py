"""Lists in OpenAI's cursor shape: `{"object": "list", "data", "first_id", "last_id",
"has_more"}`, paged by `after` (an id), `limit` and `order`."""

from __future__ import annotations

from typing import Any

from metrale.server.errors import APIError


def page_body(records: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """A list in OpenAI's cursor shape."""
    return {
        "object": "list",
        "data": records,
        "first_id": records[0]["id"] if records else None,
        "last_id": records[-1]["id"] if records else None,
        "has_more": has_more,
    }


def item_page(
    items: list[dict[str, Any]], *, after: str | None, limit: int, order: str
) -> dict[str, Any]:
    """A page of a list of items (a response's inputs, a conversation's items)."""
    ordered = items if order == "asc" else items[::-1]
    start = 0
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise APIError(f"after: no item with id {after!r} in this list", 400, param="after")
        start = ids.index(after) + 1
    chosen = ordered[start : start + limit]
    return page_body(chosen, start + limit < len(ordered))
