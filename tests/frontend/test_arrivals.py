"""Requests being read reach the engine before the output router hands out tokens: the count of
arriving requests, the router's bounded hold on it, and the server middleware that counts."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from metrale.engine.client import EngineClient
from metrale.engine.messages import EngineRequest
from metrale.engine_args import EngineArgs
from metrale.frontend.arrivals import Arrivals
from metrale.frontend.async_llm import AsyncLLM
from metrale.sampling_params import SamplingParams
from metrale.server.arrivals import ArrivalsMiddleware
from metrale.tokenizer import Tokenizer


def test_settled_waits_until_every_arriving_request_has_added_its_own():
    async def run() -> None:
        arrivals = Arrivals(hold_s=60)
        release = [asyncio.Event(), asyncio.Event()]

        async def request(i: int) -> None:
            with arrivals.arriving():
                await release[i].wait()
                Arrivals.added()
                await asyncio.sleep(0.05)  # still streaming: no longer arriving

        tasks = [asyncio.create_task(request(i)) for i in range(2)]
        await asyncio.sleep(0)
        assert arrivals.pending == 2
        waiter = asyncio.create_task(arrivals.settled())
        await asyncio.sleep(0.02)
        assert not waiter.done()
        release[0].set()
        await asyncio.sleep(0.02)
        assert arrivals.pending == 1 and not waiter.done()
        release[1].set()
        await asyncio.wait_for(waiter, 5)
        assert arrivals.pending == 0
        await asyncio.gather(*tasks)
        assert arrivals.pending == 0  # the blocks' ends count nothing twice

    asyncio.run(run())


def test_a_request_that_adds_nothing_stops_counting_when_it_ends():
    async def run() -> None:
        arrivals = Arrivals(hold_s=60)

        async def refused() -> None:
            with arrivals.arriving():
                await asyncio.sleep(0.02)
                raise ValueError("a 400: nothing reaches the engine")

        task = asyncio.create_task(refused())
        await asyncio.sleep(0)
        waiter = asyncio.create_task(arrivals.settled())
        with pytest.raises(ValueError):
            await task
        await asyncio.wait_for(waiter, 5)
        assert arrivals.pending == 0

    asyncio.run(run())


def test_the_hold_is_bounded_and_added_elsewhere_is_ignored():
    async def run() -> float:
        arrivals = Arrivals(hold_s=0.05)
        Arrivals.added()  # no request arriving in this task: nothing to end
        with arrivals.arriving():
            start = time.monotonic()
            await asyncio.wait_for(arrivals.settled(), 5)  # the request never adds
            return time.monotonic() - start

    assert 0.04 <= asyncio.run(run()) < 5


@pytest.mark.parametrize(
    ("method", "path", "counted"),
    [
        ("POST", "/v1/chat/completions", True),
        ("POST", "/v1/completions", True),
        ("POST", "/v1/messages", True),
        ("POST", "/v1/responses", True),
        ("GET", "/v1/models", False),
        ("POST", "/v1/messages/count_tokens", False),
        ("POST", "/tokenize", False),
    ],
)
def test_the_middleware_counts_the_generating_routes(method, path, counted):
    arrivals = Arrivals()
    seen = []

    async def app(scope, receive, send) -> None:
        seen.append(arrivals.pending)

    scope = {"type": "http", "method": method, "path": path}
    asyncio.run(ArrivalsMiddleware(app, arrivals)(scope, None, None))
    assert seen == [1 if counted else 0]
    assert arrivals.pending == 0


def test_a_running_stream_gets_no_tokens_while_a_request_arrives(qwen3_dir: Path):
    """The router holds the engine's outputs until the arriving request has added its own;
    the held steps then come as one delta."""
    config = EngineArgs(
        model_from_path=str(qwen3_dir), max_num_seqs=4, enforce_eager=True
    ).create_config()

    async def run() -> tuple[int, list[int]]:
        llm = AsyncLLM(
            await EngineClient.start(config, in_process=True), Tokenizer.from_dir(qwen3_dir)
        )
        llm.arrivals.hold_s = 60
        llm.start()
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        try:
            stream = llm.generate(EngineRequest("running", [5, 17, 9], params, time.time()))
            first = await anext(stream)
            sizes = [len(first.token_ids)]
            with llm.arrivals.arriving():
                later = asyncio.create_task(anext(stream))
                await asyncio.sleep(0.5)  # the engine finishes the request meanwhile
                held = later.done()
                arriving = llm.generate(EngineRequest("arriving", [7, 3], params, time.time()))
                await anext(arriving)  # it adds its request: the router lets go
                sizes.append(len((await later).token_ids))
                async for _ in arriving:
                    pass
            async for delta in stream:
                sizes.append(len(delta.token_ids))
            return held, sizes
        finally:
            await llm.shutdown()

    held, sizes = asyncio.run(run())
    assert not held
    assert sum(sizes) == 24
    assert sizes[1] > 1  # the steps held came together
