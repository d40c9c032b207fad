"""A streaming request's deadline fires only while the next delta is awaited: if it fired while
the response was sending a frame, it would cancel the send and cut the stream off without its
error event and end (the fuzzer once caught a stream ending mid-way that way)."""

from __future__ import annotations

import asyncio

import pytest

from metrale.server.generation import until_deadline


async def ticks(every_s: float):
    i = 0
    while True:
        await asyncio.sleep(every_s)
        yield i
        i += 1


def test_a_slow_consumer_is_never_cancelled_by_the_deadline():
    async def consume() -> tuple[list[int], type[BaseException] | None]:
        seen = []
        stream = until_deadline(ticks(0.01), timeout_s=0.1)
        try:
            async for item in stream:
                seen.append(item)
                await asyncio.sleep(0.06)  # a slow send: passes the deadline between items
        except TimeoutError as e:
            return seen, type(e)
        return seen, None

    seen, raised = asyncio.run(consume())
    assert raised is TimeoutError  # raised from the wait for the next item...
    assert seen == [0, 1]  # ...after the sends in flight finished


def test_the_old_pattern_cancels_the_consumer():
    """What `until_deadline` replaces: asyncio.timeout around the loop inside a generator."""

    async def old_style():
        async with asyncio.timeout(0.1):
            async for item in ticks(0.01):
                yield item

    async def consume() -> None:
        async for _ in old_style():
            await asyncio.sleep(0.06)

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(consume())


def test_no_deadline_passes_everything_and_closes_the_source():
    closed = []

    async def finite():
        try:
            for i in range(3):
                yield i
        finally:
            closed.append(True)

    async def consume() -> list[int]:
        return [item async for item in until_deadline(finite(), None)]

    assert asyncio.run(consume()) == [0, 1, 2]
    assert closed == [True]
