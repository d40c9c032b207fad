"""The Responses API's state, through the official `openai` SDK: stored responses and their
input items, `previous_response_id`, `store: false`, background responses (polled, followed,
cancelled), conversations, stored chat completions, and a restart on a SQLite store.

The server runs random weights with one sequence at a time (`--max-num-seqs 1`), so a request
can be held in the queue behind another: that is how a background response is cancelled
before it could finish.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.server.conftest import (
    MODEL_NAME,
    RunningServer,
    hold_the_engine,
    start_server,
    stop_server,
)


class Restartable:
    """A `met serve` on a SQLite store that a test can restart on the same file."""

    def __init__(self, model_dir: Path, tmp: Path) -> None:
        self.model_dir, self.tmp = model_dir, tmp
        self.store = tmp / "store" / "records.db"
        self.starts = 0
        self.server = self._start()

    def _start(self) -> RunningServer:
        self.starts += 1
        return start_server(
            self.model_dir,
            self.tmp / f"server-{self.starts}.log",
            "--max-num-seqs",
            "1",
            "--response-store",
            f"sqlite:{self.store}",
        )

    def restart(self) -> None:
        assert stop_server(self.server) == 0, self.server.log()
        self.server = self._start()

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.server.api_url, api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def served(qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Restartable]:
    running = Restartable(qwen3_dir, tmp_path_factory.mktemp("responses-state"))
    yield running
    code = stop_server(running.server)
    assert code == 0, f"met serve did not shut down cleanly ({code}):\n{running.server.log()}"


@pytest.fixture
def client(served: Restartable) -> openai.OpenAI:
    return served.client()


def create(client: openai.OpenAI, **fields: Any) -> Any:
    return client.responses.create(model=MODEL_NAME, max_output_tokens=24, **fields)


def text_items(response: Any) -> list[dict[str, Any]]:
    return [item.model_dump(exclude_none=True) for item in response.output]


# --- stored responses ----------------------------------------------------------------------------


def test_stored_response_retrieve_input_items_and_delete(client):
    r = create(
        client, input=[{"role": "user", "content": "one"}, {"role": "user", "content": "two"}]
    )
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    items = client.responses.input_items.list(r.id, order="asc")
    assert [i.content[0].text for i in items.data] == ["one", "two"]
    assert all(i.id for i in items.data)
    newest = client.responses.input_items.list(r.id, limit=1)
    assert [i.id for i in newest.data] == [items.data[-1].id] and newest.has_more
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def test_store_false_is_not_kept_and_cannot_be_continued(client):
    r = create(client, input="hello", store=False)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        create(client, input="more", previous_response_id=r.id)


def test_previous_response_id_continues_with_cache_hits(client):
    """Each turn's prompt is the one before it, its reply and the new input: the prefix cache
    serves more of each turn, and the prompt is the same as sending the whole history."""
    turns = [
        "Tell me about the sea, the wind and the old harbour town.",
        "And the boats?",
        "Go on.",
    ]
    previous, cached, history = None, [], []
    for text in turns:
        r = create(client, input=text, previous_response_id=previous)
        history += [{"role": "user", "content": text}, *text_items(r)]
        cached.append(r.usage.input_tokens_details.cached_tokens)
        previous = r.id
    assert cached[1] > 0 and cached[2] > cached[1]
    last_input = history[: -len(r.output)]
    stateless = create(client, input=last_input, store=False)
    assert stateless.usage.input_tokens == r.usage.input_tokens
    assert r.previous_response_id is not None


def test_json_schema_format_is_the_chat_routes_grammar(client):
    """Same prompt, same sampling, same grammar: the Responses route writes what chat writes."""
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["n"],
        "additionalProperties": False,
    }
    r = client.responses.create(
        model=MODEL_NAME,
        input="pick a number",
        max_output_tokens=40,
        temperature=1.0,
        extra_body={"seed": 2},
        text={"format": {"type": "json_schema", "name": "n", "schema": schema}},
    )
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "pick a number"}],
        max_tokens=40,
        temperature=1.0,
        seed=2,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
    )
    assert r.output_text == chat.choices[0].message.content
    assert 0 <= json.loads(r.output_text)["n"] <= 99


# --- the context window --------------------------------------------------------------------------

LONG = "word " * 600  # past the test server's 512-token window


def test_too_long_input_fails_with_context_length_exceeded(client):
    with pytest.raises(openai.BadRequestError) as e:
        create(client, input=LONG)
    assert e.value.code == "context_length_exceeded"
    # Streamed, as Codex reads it: a failed response carrying the code.
    with client.responses.create(model=MODEL_NAME, input=LONG, stream=True) as stream:
        events = list(stream)
    assert [e.type for e in events] == ["response.created", "response.failed"]
    assert events[-1].response.error.code == "context_length_exceeded"


def test_truncation_auto_drops_the_oldest_items(client):
    items = [
        {"role": "user", "content": LONG},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "short question"},
    ]
    r = create(client, input=items, truncation="auto")
    assert r.status in ("completed", "incomplete")
    alone = create(client, input=items[1:], store=False)
    assert r.usage.input_tokens == alone.usage.input_tokens


# --- background responses ------------------------------------------------------------------------


def test_background_response_is_polled_to_completion(client):
    r = create(client, input="in the background", background=True)
    assert r.status in ("queued", "in_progress") and r.background
    deadline = time.monotonic() + 60
    while r.status in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.05)
        r = client.responses.retrieve(r.id)
    assert r.status in ("completed", "incomplete") and r.usage.output_tokens > 0


def test_background_response_is_cancelled_while_queued(served, client):
    holder = hold_the_engine(served.server)
    try:
        r = create(client, input="never mind", background=True)
        cancelled = client.responses.cancel(r.id)
        assert cancelled.status == "cancelled"
        assert client.responses.retrieve(r.id).status == "cancelled"
    finally:
        holder.join()
    with pytest.raises(openai.BadRequestError, match="background"):
        client.responses.cancel(create(client, input="not background").id)


def test_background_response_can_be_followed_as_a_stream(served, client):
    holder = hold_the_engine(served.server)
    try:
        r = create(client, input="follow me", background=True)
        with client.responses.retrieve(r.id, stream=True) as stream:
            events = list(stream)
    finally:
        holder.join()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created"
    assert events[-1].type in ("response.completed", "response.incomplete")
    final = client.responses.retrieve(r.id)
    assert events[-1].response.output_text == final.output_text
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text


def test_background_stream_is_detached_from_its_client(client):
    """Streamed and background: the events come as for any stream, and the run is stored."""
    with client.responses.create(
        model=MODEL_NAME, input="detached", background=True, stream=True, max_output_tokens=12
    ) as stream:
        events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created"
    assert events[-1].type in ("response.completed", "response.incomplete")
    stored = client.responses.retrieve(events[-1].response.id)
    assert stored.output_text == events[-1].response.output_text and stored.background


# --- conversations -------------------------------------------------------------------------------


def test_conversation_holds_the_turns(client):
    conversation = client.conversations.create(
        items=[{"type": "message", "role": "user", "content": "Hello, remember me."}],
        metadata={"topic": "test"},
    )
    assert conversation.id.startswith("conv_") and conversation.metadata == {"topic": "test"}
    first = create(client, input="first question", conversation=conversation.id)
    second = create(client, input="second question", conversation={"id": conversation.id})
    assert second.conversation.id == conversation.id
    items = client.conversations.items.list(conversation.id, order="asc", limit=100).data
    # The first item, then each turn's input and output.
    assert len(items) == 1 + (1 + len(first.output)) + (1 + len(second.output))
    assert [i.id for i in items[-len(second.output) :]] == [o.id for o in second.output]
    # The second turn's prompt held the whole conversation.
    history = [
        {"role": "user", "content": "Hello, remember me."},
        {"role": "user", "content": "first question"},
        *text_items(first),
        {"role": "user", "content": "second question"},
    ]
    assert (
        create(client, input=history, store=False).usage.input_tokens == second.usage.input_tokens
    )
    one = client.conversations.items.retrieve(items[0].id, conversation_id=conversation.id)
    assert one.id == items[0].id
    added = client.conversations.items.create(
        conversation.id, items=[{"type": "message", "role": "user", "content": "a note"}]
    )
    assert len(added.data) == 1
    client.conversations.items.delete(added.data[0].id, conversation_id=conversation.id)
    assert len(client.conversations.items.list(conversation.id, limit=100).data) == len(items)
    updated = client.conversations.update(conversation.id, metadata={"topic": "changed"})
    assert client.conversations.retrieve(conversation.id).metadata == updated.metadata
    client.conversations.delete(conversation.id)
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(conversation.id)


# --- stored chat completions ---------------------------------------------------------------------


def test_stored_chat_completions_list_update_and_delete(client):
    tag = f"run-{time.monotonic_ns()}"
    ids = []
    for i in range(3):
        out = client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": f"question {i}"}],
            max_tokens=4,
            store=True,
            metadata={"tag": tag, "i": str(i)},
        )
        ids.append(out.id)
    listed = client.chat.completions.list(metadata={"tag": tag}, limit=2)
    assert [c.id for c in listed.data] == ids[:2] and listed.has_more
    rest = client.chat.completions.list(metadata={"tag": tag}, after=ids[1])
    assert [c.id for c in rest.data] == ids[2:]
    newest = client.chat.completions.list(metadata={"tag": tag}, order="desc", limit=1)
    assert [c.id for c in newest.data] == ids[-1:]
    messages = client.chat.completions.messages.list(ids[0])
    assert [m.content for m in messages.data] == ["question 0"]
    updated = client.chat.completions.update(ids[0], metadata={"tag": "other"})
    assert updated.metadata == {"tag": "other"}
    assert len(client.chat.completions.list(metadata={"tag": tag}).data) == 2
    deleted = client.chat.completions.delete(ids[1])
    assert deleted.deleted
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.retrieve(ids[1])


def test_a_streamed_chat_completion_is_stored_as_sent(client):
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "stream and keep"}],
        max_tokens=12,
        store=True,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    stored = client.chat.completions.retrieve(chunks[0].id)
    assert stored.choices[0].message.content == text
    assert stored.usage.completion_tokens == chunks[-1].usage.completion_tokens


# --- a restart -----------------------------------------------------------------------------------


def test_responses_and_conversations_survive_a_restart(served):
    client = served.client()
    conversation = client.conversations.create()
    r = create(client, input="before the restart", conversation=conversation.id)
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "kept"}], max_tokens=2, store=True
    )
    items = client.conversations.items.list(conversation.id).data
    served.restart()
    client = served.client()
    assert client.responses.retrieve(r.id).model_dump() == r.model_dump()
    assert [i.id for i in client.conversations.items.list(conversation.id).data] == [
        i.id for i in items
    ]
    assert client.chat.completions.retrieve(chat.id).id == chat.id
    after = create(client, input="after the restart", previous_response_id=r.id)
    stateless = create(
        client,
        store=False,
        input=[
            {"role": "user", "content": "before the restart"},
            *text_items(r),
            {"role": "user", "content": "after the restart"},
        ],
    )
    assert after.usage.input_tokens == stateless.usage.input_tokens
    # The conversation goes on too: its next turn reads the items stored before the restart.
    turn = create(client, input="after the restart", conversation=conversation.id)
    assert turn.usage.input_tokens == stateless.usage.input_tokens
    assert len(client.conversations.items.list(conversation.id, limit=100).data) == len(
        items
    ) + 1 + len(turn.output)
