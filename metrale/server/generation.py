"""Running one API request through the engine: fan-out for `n`, timeouts, disconnects.

Shared by every route that generates. A request becomes `n` engine requests (seeds offset per
choice, so `n` seeded choices differ); their delta streams are merged, each delta tagged with
its choice index. Leaving the merged stream early — a client disconnect, a timeout, an error —
closes every child stream, which aborts the engine requests and frees their KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import TypeVar

from fastapi import Request

from metrale.engine.client import EngineDeadError
from metrale.engine.core import validate_request
from metrale.engine.messages import EngineRequest
from metrale.frontend.async_llm import RequestRejectedError
from metrale.frontend.dry_breakers import resolve_dry_breakers
from metrale.frontend.output_processor import CompletionDelta
from metrale.outputs import PositionLogprobs
from metrale.sampling_params import SamplingParams
from metrale.server import access_log, compaction
from metrale.server.errors import INT64_MIN, APIError
from metrale.server.security.guard import CLIENT_SCOPE_KEY, Admission
from metrale.server.state import ServerState

T = TypeVar("T")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass
class Choice:
    """One choice, accumulated from its deltas."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    def add(self, delta: CompletionDelta) -> None:
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + delta.logprobs
        self.finish_reason = delta.finish_reason
        self.stop_reason = delta.stop_reason


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0

    def body(self) -> dict[str, object]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
            **compaction.usage_field(),
        }


@dataclass(frozen=True)
class PreparedPrompt:
    """A validated prompt and the engine requests of its choices."""

    request_id: str
    prompt_token_ids: list[int]
    children: list[EngineRequest]
    # False: every engine step's delta reaches the consumer on its own, even when it falls
    # behind (one that counts tokens per delta: `ChatOutputParser.counts_per_delta`).
    coalesce: bool = True


# --request-timeout is the API's to answer (an error in the API's shape); the engine enforces it
# too, this much later, so a request's compute ends even when the API process cannot end it.
ENGINE_DEADLINE_GRACE_S = 1.0


def prepare(
    state: ServerState,
    request_id: str,
    prompt_token_ids: list[int],
    params: SamplingParams,
    n: int,
    priority: int = 0,
) -> PreparedPrompt:
    """Validate before anything is queued or streamed; failures are 400s."""
    params = resolve_dry_breakers(params, state.tokenizer)
    if priority != 0 and state.config.scheduler.policy != "priority":
        raise APIError(
            f"priority={priority}: this server schedules {state.config.scheduler.policy}; "
            "start it with --scheduler priority to serve requests by priority",
            param="priority",
        )
    max_seq_len = state.config.scheduler.max_seq_len
    num_prompt = len(prompt_token_ids)
    if params.max_tokens is not None and num_prompt + params.max_tokens > max_seq_len:
        raise APIError(
            f"this model's maximum context length is {max_seq_len} tokens; the request asks "
            f"for {num_prompt + params.max_tokens} ({num_prompt} in the prompt, "
            f"{params.max_tokens} for the completion): shorten the prompt or lower max_tokens",
            param="max_tokens",
        )
    # Arrival is when the HTTP request came in (its access-log record's start), so the server's
    # TTFT and E2E latency count parsing, templating and tokenizing as its client does.
    record = access_log.current_record()
    now = record.start_s if record is not None else time.monotonic()
    timeout_s = state.settings.request_timeout_s
    deadline_s = None if timeout_s is None else now + timeout_s + ENGINE_DEADLINE_GRACE_S
    children = []
    for i in range(n):
        child_params = params
        if n > 1 and params.seed is not None:
            seed = (params.seed + i - INT64_MIN) % 2**64 + INT64_MIN  # stays an int64
            child_params = dataclasses.replace(params, seed=seed)
        child = EngineRequest(
            f"{request_id}-{i}",
            prompt_token_ids,
            child_params,
            now,
            priority,
            deadline_s,
            tenant=None if record is None else record.tenant,
        )
        try:
            validate_request(state.config, child)
        except ValueError as e:
            raise APIError(str(e), param="messages" if "prompt" in str(e) else None) from None
        children.append(child)
    return PreparedPrompt(request_id, prompt_token_ids, children)


def check_token_ids(token_ids: list[int], vocab_size: int, param: str) -> None:
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise APIError(
            f"token id {bad} is out of range: ids must be in [0, {vocab_size})", param=param
        )


def admit(request: Request, state: ServerState, prompts: list[PreparedPrompt]) -> Admission:
    """Charge the request's tokens to its client's rate limit and check the queue bound, before
    anything reaches the engine; raises the 429 (or Anthropic's 529) that refuses it."""
    children = [child for prompt in prompts for child in prompt.children]
    guard = state.guard
    return guard.admit(
        request.scope.get("state", {}).get(CLIENT_SCOPE_KEY),
        prompt_tokens=sum(len(child.prompt_token_ids) for child in children),
        output_tokens=sum(child.sampling_params.max_tokens or 0 for child in children),
        num_waiting=state.llm.num_waiting if guard.config.max_queued_requests else 0,
        n=len(children),
    )


def default_max_tokens(state: ServerState, num_prompt_tokens: int) -> int:
    return max(state.config.scheduler.max_seq_len - num_prompt_tokens, 1)


def stream_deltas(
    state: ServerState,
    prompts: list[PreparedPrompt],
    admission: Admission | None = None,
    timeout_s: float | None = None,
) -> AsyncIterator[tuple[int, CompletionDelta]]:
    """Deltas of every choice of every prompt, as (choice index, delta), interleaved. When the
    stream ends, however it ends, `admission` is refunded the tokens that were not generated.
    Past `timeout_s` it raises TimeoutError (see `until_deadline`).

    A choice ends with the first delta that is finished when the consumer hands control back:
    the engine finished it, or the consumer marked it finished (a stop only the API can see,
    as `ChatOutputParser.take` does), which aborts its engine request."""
    return until_deadline(_merged_deltas(state, prompts, admission), timeout_s)


def until_deadline(stream: AsyncIterator[T], timeout_s: float | None) -> AsyncIterator[T]:
    """`stream`'s items until `timeout_s` from the first wait for one, then TimeoutError;
    without a timeout, `stream` itself (no layer that every item passes through).

    The deadline is only armed while the next item is awaited, never across a `yield`: an
    `asyncio.timeout` around a streaming loop can fire while the consumer is sending a frame,
    and then it cancels the send instead, cutting the response off without its end.
    """
    return stream if timeout_s is None else _until_deadline(stream, timeout_s)


async def _until_deadline(stream: AsyncIterator[T], timeout_s: float) -> AsyncIterator[T]:
    iterator = aiter(stream)
    try:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            async with asyncio.timeout_at(deadline):
                try:
                    item = await anext(iterator)
                except StopAsyncIteration:
                    return
            yield item
    finally:
        await iterator.aclose()  # type: ignore[attr-defined]


async def _merged_deltas(
    state: ServerState, prompts: list[PreparedPrompt], admission: Admission | None
) -> AsyncIterator[tuple[int, CompletionDelta]]:
    record = access_log.current_record()
    api = record.api if record is not None else "unknown"
    children = [(child, prompt.coalesce) for prompt in prompts for child in prompt.children]
    streams = [state.llm.generate(child, api, coalesce=merge) for child, merge in children]
    if record is not None:
        record.add_prompt(sum(len(child.prompt_token_ids) for child, _ in children))
    generated = 0
    if admission is not None:
        admission.started()
    try:
        if len(streams) == 1:
            async for delta in streams[0]:
                generated += len(delta.token_ids)
                if record is not None:
                    record.add(delta)
                yield 0, delta
                if delta.finished:
                    return
            return
        queue: asyncio.Queue[tuple[int, CompletionDelta | None] | BaseException] = asyncio.Queue()

        async def pump(index: int, stream: AsyncIterator[CompletionDelta]) -> None:
            try:
                async for delta in stream:
                    queue.put_nowait((index, delta))
                queue.put_nowait((index, None))
            except Exception as e:
                queue.put_nowait(e)

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        try:
            open_choices = set(range(len(tasks)))
            while open_choices:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                index, delta = item
                if index not in open_choices:  # queued before the consumer ended it
                    continue
                if delta is None:
                    open_choices.discard(index)
                    continue
                generated += len(delta.token_ids)
                if record is not None:
                    record.add(delta)
                yield index, delta
                if delta.finished:
                    open_choices.discard(index)
                    tasks[index].cancel()  # its engine request is aborted, if still running
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        if admission is not None:
            admission.settle(generated)
        for stream in streams:
            with contextlib.suppress(Exception):
                await stream.aclose()  # type: ignore[attr-defined]


def engine_error(e: Exception) -> APIError:
    """Errors raised while generating, in the API's terms."""
    if isinstance(e, EngineDeadError):
        return APIError(f"the engine is not running ({e}); restart the server", 503)
    if isinstance(e, RequestRejectedError):
        return APIError(str(e), 400)
    if isinstance(e, TimeoutError):
        return APIError("the request timed out (--request-timeout)", 408)
    return APIError(f"internal error: {type(e).__name__}: {e}", 500)


async def until_disconnected(request: Request, work: Awaitable[T], timeout_s: float | None) -> T:
    """Await `work`, cancelling it if the client disconnects or the timeout passes."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                task.cancel()
                return

    watcher = asyncio.create_task(watch())
    try:
        async with asyncio.timeout(timeout_s):
            return await task
    finally:
        watcher.cancel()
        task.cancel()
