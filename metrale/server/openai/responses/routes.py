"""`/v1/responses`: OpenAI's Responses API, stateful, over the chat route's machinery.

A request's conversation (the stored history of `previous_response_id` or `conversation`, then
its `input`) becomes a chat request (`translate.py`) and runs through the same prompt rendering,
planning, engine fan-in and output parser as `/v1/chat/completions`; the reply is split into
output items (`items.py`). Streamed, the events are those of OpenAI's streaming reference, each
numbered by `sequence_number`:

    response.created, response.in_progress, <each item's events>,
    then one of response.completed, response.incomplete, response.failed

A prompt longer than the context window is a `context_length_exceeded` error: a 400 before a
non-streamed response, and a `response.failed` carrying that code in a stream, which is where
Codex looks for it. `truncation: "auto"` drops the oldest items until the prompt fits.

`store` (the default) keeps the response and its input (`records.py`); `background` runs it
detached: the answer is the queued response, `GET` polls it (or follows its events with
`?stream=true`), and `/cancel` stops it.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse

from metrale.server import compaction, sse
from metrale.server.chat_request import build_prompt, plan_generation, report_output
from metrale.server.errors import APIError, parse_body
from metrale.server.generation import admit, engine_error, stream_deltas, until_disconnected
from metrale.server.json_body import JSONResponse
from metrale.server.openai.pages import item_page
from metrale.server.openai.responses import records
from metrale.server.openai.responses.background_peers import stop_run
from metrale.server.openai.responses.protocol import ResponsesRequest
from metrale.server.openai.responses.run import ResponseRun
from metrale.server.openai.responses.translate import ToolSet, chat_request, tool_set
from metrale.server.protocol import ChatCompletionRequest
from metrale.server.reply_parts import Event
from metrale.server.state import ServerState

router = APIRouter()
Order = Literal["asc", "desc"]


@router.post("/v1/responses")
async def create_response(request: Request) -> Any:
    state: ServerState = request.app.state.server
    body = await parse_body(request, ResponsesRequest)
    state.check_model(body.model)
    state.check_alive()
    tools = tool_set(body.tools)
    if body.previous_response_id is not None:
        past = records.history(state.store, body.previous_response_id)
    elif (conversation_id := body.conversation_id) is not None:
        past = records.conversation_record(state.store, conversation_id, "conversation")["items"]
    else:
        past = []
    input_items = records.item_dicts(body.input_items())
    run = ResponseRun(f"resp_{uuid.uuid4().hex}", body, state.settings.served_model_name, tools)
    try:
        _plan(state, run, records.parsed_items(past) + body.input_items())
    except APIError as e:
        if not (body.stream and e.code == "context_length_exceeded"):
            raise
        run.end("failed", e)
        return _event_stream(_failed_stream(run))
    assert run.prompt is not None
    run.admission = admit(request, state, [run.prompt])
    if body.background:
        queued = _start_background(state, run, input_items)
        if body.stream:  # the run is detached: the client may leave and follow it again later
            return _event_stream(_frame(event) async for event in run.follow())
        return JSONResponse(queued)
    if body.stream:
        return _event_stream(_stream(state, run, input_items))
    try:
        await until_disconnected(
            request, _drain(_generate(state, run)), state.settings.request_timeout_s
        )
    except APIError:
        raise
    except Exception as e:
        raise engine_error(e) from e
    return JSONResponse(_finish(state, run, input_items))


def _plan(state: ServerState, run: ResponseRun, items: list[Any]) -> None:
    """The prompt and engine request of `run`'s conversation `items`."""
    max_seq_len = state.config.scheduler.max_seq_len
    chat, prompt_text, prompt_ids = _render(state, run.body, items, run.tools)
    if len(prompt_ids) >= max_seq_len and run.body.truncation == "auto":
        chat, prompt_text, prompt_ids = _truncated(state, run.body, items, run.tools)
    if len(prompt_ids) >= max_seq_len:
        raise APIError(
            f"this model's maximum context length is {max_seq_len} tokens, and the input is "
            f"{len(prompt_ids)}: shorten the input, or send truncation: auto",
            400,
            param="input",
            code="context_length_exceeded",
        )
    # As on /v1/messages: the reply may run to the window's end (clients ask for more than a
    # small model's window holds); hitting it makes the response incomplete.
    room = max_seq_len - len(prompt_ids)
    max_tokens = min(run.body.max_output_tokens or room, room)
    run.prompt, (run.parser,) = plan_generation(
        state,
        chat,
        prompt_text,
        prompt_ids,
        run.id,
        max_tokens=max_tokens,
        max_tool_calls=run.body.max_tool_calls,
    )
    run.usage.prompt_tokens = len(prompt_ids)
    run.compacted = compaction.usage_field()  # read now: a background run outlives the POST


def _render(
    state: ServerState, body: ResponsesRequest, items: list[Any], tools: ToolSet
) -> tuple[ChatCompletionRequest, str, list[int]]:
    chat = chat_request(body, items, tools)
    return (chat, *build_prompt(state, chat))


def _truncated(
    state: ServerState, body: ResponsesRequest, items: list[Any], tools: ToolSet
) -> tuple[ChatCompletionRequest, str, list[int]]:
    """The conversation without as few of its oldest items as make it fit (instructions
    stay): the fewest dropped, found by bisection, since dropping more never lengthens it."""
    limit = state.config.scheduler.max_seq_len
    low, high = 1, max(len(items) - 1, 1)  # keep at least the newest item
    best = _render(state, body, items[high:], tools)
    while low < high:
        middle = (low + high) // 2
        rendered = _render(state, body, items[middle:], tools)
        if len(rendered[2]) < limit:
            high, best = middle, rendered
        else:
            low = middle + 1
    return best


async def _generate(state: ServerState, run: ResponseRun) -> AsyncIterator[Event]:
    """The run's item events, as the engine's deltas settle them; its usage counted at the end."""
    assert run.prompt is not None and run.parser is not None
    timeout = state.settings.request_timeout_s
    async for _, delta in stream_deltas(state, [run.prompt], run.admission, timeout):
        for event in run.add(delta):
            yield event
    reasoning = run.parser.reasoning_text
    if reasoning:
        run.count_reasoning(len(state.tokenizer.encode(reasoning, add_special_tokens=False)))
    report_output(state, [run.parser], run.usage.reasoning_tokens)


async def _drain(events: AsyncIterator[Event]) -> None:
    async for _ in events:
        pass


def _finish(state: ServerState, run: ResponseRun, input_items: list[dict[str, Any]]) -> dict:
    """The final response object; stored, and its items added to its conversation, as asked."""
    body = run.body_dict()
    if run.body.store:
        records.save_response(state.store, body, input_items)
    conversation_id = run.body.conversation_id
    if conversation_id is not None and run.status in ("completed", "incomplete"):
        record = state.store.get(records.CONVERSATION, conversation_id)
        if record is not None:  # deleted while the response ran: nothing to add to
            record["items"] += input_items + body["output"]
            records.save_conversation(state.store, record)
    return body


def _event_stream(events: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream")


def _frame(event: Event) -> bytes:
    """An SSE frame named, as OpenAI's are, by its event's type."""
    return sse.event(event, event["type"])


async def _failed_stream(run: ResponseRun) -> AsyncIterator[bytes]:
    """A response that fails before it starts, as a stream: created, then failed."""
    yield _frame(run.numbered({"type": "response.created", "response": run.body_dict()}))
    yield _frame(run.numbered({"type": "response.failed", "response": run.body_dict()}))


async def _stream(
    state: ServerState, run: ResponseRun, input_items: list[dict[str, Any]]
) -> AsyncIterator[bytes]:
    yield _frame(run.numbered({"type": "response.created", "response": run.body_dict()}))
    yield _frame(run.numbered({"type": "response.in_progress", "response": run.body_dict()}))
    events = _events(state, run, input_items)
    try:
        async for event in events:
            yield _frame(run.numbered(event))
    finally:
        await events.aclose()  # aborts the engine request if the client left
        if not run.done:
            run.end("cancelled")
            run.items.finish("incomplete")
            _finish(state, run, input_items)


async def _events(
    state: ServerState, run: ResponseRun, input_items: list[dict[str, Any]]
) -> AsyncIterator[Event]:
    """The item events, then the final one; a failure closes the open item and fails the run."""
    try:
        async for event in _generate(state, run):
            yield event
    except asyncio.CancelledError:
        raise
    except Exception as e:
        error = e if isinstance(e, APIError) else engine_error(e)
        run.end("failed", error)
        for event in run.items.finish("incomplete"):
            yield event
    body = _finish(state, run, input_items)
    yield {"type": run.final_event, "response": body}


# -- background responses ----------------------------------------------------------------------


def _start_background(
    state: ServerState, run: ResponseRun, input_items: list[dict[str, Any]]
) -> dict[str, Any]:
    queued = _finish(state, run, input_items)
    task = asyncio.create_task(_run_background(state, run, input_items))
    state.background[run.id] = (task, run)
    if (peers := state.background_peers) is not None:
        peers.started(run.id)  # the other API processes answer for it too

    def ended(_: asyncio.Task) -> None:
        state.background.pop(run.id, None)
        if peers is not None:
            peers.ended(run.id)

    task.add_done_callback(ended)
    return queued


async def _run_background(
    state: ServerState, run: ResponseRun, input_items: list[dict[str, Any]]
) -> None:
    run.status = "in_progress"
    run.log({"type": "response.created", "response": run.body_dict()})
    run.log({"type": "response.in_progress", "response": _finish(state, run, input_items)})
    try:
        async for event in _events(state, run, input_items):
            run.log(event)
    except asyncio.CancelledError:  # /cancel: the engine request is aborted as the stream closes
        run.end("cancelled")
        for event in run.items.finish("incomplete"):
            run.log(event)
        run.log({"type": run.final_event, "response": _finish(state, run, input_items)})


def _stored_response(state: ServerState, response_id: str) -> dict[str, Any]:
    """A stored response as it stands; a background one that was running when the server
    stopped has failed (nothing runs it any more)."""
    response = records.response_record(state.store, response_id)["response"]
    if response["status"] in ("queued", "in_progress") and _owner(state, response_id) is None:
        response["status"] = "failed"
        response["error"] = {
            "code": "server_error",
            "message": "the server stopped while this response was running",
        }
    return response


@router.get("/v1/responses/{response_id}")
async def get_response(
    request: Request,
    response_id: str,
    stream: bool = False,
    starting_after: Annotated[int, Query(ge=-1)] = -1,
) -> Any:
    state: ServerState = request.app.state.server
    response = _stored_response(state, response_id)
    if not stream:
        return JSONResponse(response)
    owner = _owner(state, response_id)
    if owner is None:
        raise APIError(
            "stream: only a background response that is running can be streamed again; "
            "fetch this one without stream",
            400,
            param="stream",
        )
    if owner == "here":
        events = state.background[response_id][1].follow(starting_after)
    else:  # another API process runs it: its events come from there
        assert state.background_peers is not None
        events = await state.background_peers.follow(owner, response_id, starting_after)
    return _event_stream(_frame(event) async for event in events)


@router.delete("/v1/responses/{response_id}")
async def delete_response(request: Request, response_id: str) -> Any:
    state: ServerState = request.app.state.server
    records.response_record(state.store, response_id)
    await _stop_background(state, response_id)
    state.store.delete(records.RESPONSE, response_id)
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(request: Request, response_id: str) -> Any:
    state: ServerState = request.app.state.server
    record = records.response_record(state.store, response_id)
    response = record["response"]
    if not response.get("background"):
        raise APIError(
            "only background responses can be cancelled (this one ran in its request)",
            400,
            param="response_id",
        )
    stopped = await _stop_background(state, response_id)
    if not stopped and response["status"] in ("queued", "in_progress"):
        # Orphaned by a restart: nothing runs it, so it ends here.
        response["status"] = "cancelled"
        records.save_response(state.store, response, record["input"])
    return JSONResponse(_stored_response(state, response_id))


def _owner(state: ServerState, response_id: str) -> Literal["here"] | int | None:
    """Where a background response runs: this process, another API process (its index), or
    nowhere (finished, or orphaned by a restart)."""
    if response_id in state.background:
        return "here"
    if state.background_peers is not None:
        return state.background_peers.owner(response_id)
    return None


async def _stop_background(state: ServerState, response_id: str) -> bool:
    owner = _owner(state, response_id)
    if owner == "here":
        return await stop_run(state.background, response_id)
    if owner is not None:
        assert state.background_peers is not None
        return await state.background_peers.cancel(owner, response_id)
    return False


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(
    request: Request,
    response_id: str,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Order = "desc",
) -> Any:
    state: ServerState = request.app.state.server
    items = records.response_record(state.store, response_id)["input"]
    return JSONResponse(item_page(items, after=after, limit=limit, order=order))
