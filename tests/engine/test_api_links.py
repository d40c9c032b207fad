"""One engine core serving several API processes (`--api-server-count`): each client gets its own
requests' outputs and refusals, every client the pool's state, the first the step figures."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path

import zmq

from metrale.engine.client import EngineClient, EngineDeadError, EngineProcess
from metrale.engine.core_loop import ApiLinks
from metrale.engine.messages import EngineOutput, EngineRequest, KVCacheStats, Outputs, decode
from metrale.engine.spawn import EngineSockets
from metrale.engine_args import EngineArgs
from metrale.sampling_params import SamplingParams

PROMPT = [5, 17, 9, 33, 12, 8, 41]
NUM_TOKENS = 12


def _request(request_id: str, first: int) -> EngineRequest:
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    return EngineRequest(request_id, [first, *PROMPT], params, time.time())


async def _drain(client: EngineClient, until_finished: set[str]) -> list[Outputs]:
    batches: list[Outputs] = []
    finished: set[str] = set()
    while not until_finished <= finished:
        for batch in [await client.get_outputs(), *client.ready_outputs()]:
            batches.append(batch)
            finished |= {o.request_id for o in batch.outputs if o.finished}
            finished |= {request_id for request_id, _ in batch.rejected}
    return batches


def _tokens(batches: list[Outputs]) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for batch in batches:
        for output in batch.outputs:
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
    return tokens


def test_each_api_process_gets_its_own_requests(qwen3_dir: Path):
    config = EngineArgs(
        model_from_path=str(qwen3_dir), max_num_seqs=8, enforce_eager=True
    ).create_config()

    async def run() -> tuple[list[Outputs], list[Outputs], dict[str, list[int]]]:
        first = EngineClient.launch(config, in_process=True, api_server_count=2)
        # The engine runs in a thread here: "its process" is this one.
        second = EngineClient.attach(first.sockets, 1, os.getpid())
        try:
            await asyncio.gather(first.ready(config), second.ready(config))
            first.add_request(_request("a", 3))
            second.add_request(_request("b", 4))
            second.add_request(_request("a", 5))  # an id the engine has: refused, to its sender
            ones, twos = await asyncio.gather(_drain(first, {"a"}), _drain(second, {"a", "b"}))
            # Alone on the engine, for reference.
            first.add_request(_request("b-alone", 4))
            alone = _tokens(await _drain(first, {"b-alone"}))
            return ones, twos, alone
        finally:
            await second.shutdown()
            await first.shutdown()

    ones, twos, alone = asyncio.run(run())
    assert set(_tokens(ones)) == {"a"} and len(_tokens(ones)["a"]) == NUM_TOKENS
    assert set(_tokens(twos)) == {"b"}
    assert _tokens(twos)["b"] == alone["b-alone"]  # batched with "a", the same greedy tokens
    refused = [r for batch in twos for r in batch.rejected]
    assert [request_id for request_id, _ in refused] == ["a"]
    assert "already in the engine" in refused[0][1]
    assert not any(batch.rejected for batch in ones)
    # The engine's own figures reach the first process only; the pool's state reaches both.
    assert sum(len(batch.steps) for batch in ones) > 0
    assert all(not batch.steps for batch in twos)
    assert all(batch.kv_cache.num_blocks > 0 for batch in ones + twos)


def test_an_attached_process_sees_the_engine_stop(qwen3_dir: Path):
    config = EngineArgs(model_from_path=str(qwen3_dir), enforce_eager=True).create_config()

    async def run() -> tuple[bool, bool, str | None]:
        first = EngineClient.launch(config, api_server_count=2)
        assert first.engine_pid is not None
        second = EngineClient.attach(first.sockets, 1, first.engine_pid)
        try:
            await asyncio.gather(first.ready(config), second.ready(config))
            alive_before = second.is_alive
            await first.shutdown()  # the first API process stops the engine
            try:
                await asyncio.wait_for(second.get_outputs(), 10)
            except EngineDeadError as e:
                return alive_before, second.is_alive, str(e)
            return alive_before, second.is_alive, None
        finally:
            await second.shutdown()
            await first.shutdown()

    alive_before, alive_after, error = asyncio.run(run())
    assert alive_before and not alive_after
    assert error is not None and "exited" in error


def test_a_process_id_that_exited_is_not_alive():
    assert EngineProcess(os.getpid()).is_alive()
    assert not EngineProcess(2**22 + 12345).is_alive()


def _pool(num_running: int) -> KVCacheStats:
    counts = dict.fromkeys(("num_used_blocks", "num_cached_blocks", "bytes_per_block"), 0)
    counts |= dict.fromkeys(("num_prefix_queried_tokens", "num_prefix_hit_tokens"), 0)
    counts |= dict(num_waiting=0, num_preemptions=0)
    return KVCacheStats(num_blocks=64, block_size=16, num_running=num_running, **counts)


def test_a_process_that_stops_reading_does_not_stop_the_engine(tmp_path: Path):
    """Its batches wait in the engine's backlog, merged, while the other process gets each of
    its own; once it reads again it gets every output in order and the pool's latest state."""
    context = zmq.Context()
    sockets = EngineSockets(tmp_path, num_clients=2)
    readers = []
    for client in range(2):
        reader = context.socket(zmq.PULL)
        reader.bind(sockets.output(client))
        readers.append(reader)
        context.socket(zmq.PUSH).bind(sockets.input(client))
    links = ApiLinks(context, sockets)
    links.added(0, "mine")
    links.added(1, "stalled")
    sends = 0

    def engine() -> None:
        nonlocal sends
        while not links.backlogged or sends < 50:  # well past the point where it filled up
            token = sends
            outputs = [
                EngineOutput("mine", [token], [], None, 0),
                EngineOutput("stalled", [token], [], None, 0),
            ]
            links.send(outputs, _pool(sends), [], [])
            sends += 1
            assert sends < 200_000, "the stalled process's socket never filled up"

    def first_reads() -> list[int]:
        tokens, deadline = [], time.monotonic() + 30
        while (len(tokens) < sends or worker.is_alive()) and time.monotonic() < deadline:
            if readers[0].poll(50):
                _, batch = decode(readers[0].recv_multipart())
                tokens += [t for o in batch.outputs for t in o.new_token_ids]
        return tokens

    worker = threading.Thread(target=engine)
    worker.start()
    mine = first_reads()
    assert not worker.is_alive(), "a process that does not read blocked the engine"
    assert mine == list(range(sends))

    stalled, last_pool = [], None
    while len(stalled) < sends:
        links.flush()  # as the engine's loop does each turn
        if readers[1].poll(50):
            _, batch = decode(readers[1].recv_multipart())
            stalled += [t for o in batch.outputs for t in o.new_token_ids]
            last_pool = batch.kv_cache
    assert stalled == list(range(sends))
    assert last_pool is not None and last_pool.num_running == sends - 1
    assert not links.backlogged
    links.close()
    context.destroy(linger=0)
