"""Several engine cores behind one API process (`--data-parallel-size N`), as one client.

Each core is an engine process of its own (`EngineClient`), with its own devices, KV pool and
prefix cache, possibly tensor-parallel itself. `DataParallelClient` answers to what the API
process asks of one `EngineClient`: a request goes to the core the `RequestRouter` picks
(prefix-cache affinity, then load) and its aborts follow it there; each core's output batches
arrive through one queue, marked with their core, and carry the pool state of every core summed
(`kv_cache`, what `/memory` and `/metrics` show) besides each core's own (`engines`). One core
that dies takes the whole client down, as one engine's death does: every open request fails
and `/health` turns red.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

import msgspec

from metrale.engine.client import EngineClient, EngineDeadError
from metrale.engine.messages import (
    EngineRequest,
    ForwardInfo,
    KVCacheStats,
    Outputs,
    SpecDecodeStats,
)
from metrale.engine.request_router import RequestRouter
from metrale.engine.swap_space import SwapStats
from metrale.engine_config import EngineConfig


class DataParallelClient:
    def __init__(self, clients: list[EngineClient]) -> None:
        self.clients = clients
        # Requests a core may take: the smallest pool's (every core validates the same way).
        self.config = min((c.config for c in clients), key=lambda c: c.cache.num_blocks or 0)
        self.forward: ForwardInfo | None = clients[0].forward
        self.kv_caches: list[KVCacheStats | None] = [c.kv_cache for c in clients]
        self.router = RequestRouter(len(clients), self.config.cache.block_size)
        self._owner: dict[str, int] = {}  # request id -> its core
        self._queue: asyncio.Queue[tuple[int, Outputs] | EngineDeadError] = asyncio.Queue()
        self._readers: list[asyncio.Task[None]] = []
        self._error: EngineDeadError | None = None  # a core's death, met by `ready_outputs`

    @classmethod
    async def start(cls, config: EngineConfig, *, in_process: bool = False) -> DataParallelClient:
        """Start every core (loading at once) and wait until all have loaded the model."""
        return await cls.ready(cls.launch(config, in_process=in_process), config)

    @staticmethod
    def launch(
        config: EngineConfig, *, in_process: bool = False, api_server_count: int = 1
    ) -> list[EngineClient]:
        """Start every core without waiting (each serving `api_server_count` API processes)."""
        return [
            EngineClient.launch(
                config.for_core(i), in_process=in_process, api_server_count=api_server_count
            )
            for i in range(config.data_parallel_size)
        ]

    @classmethod
    async def ready(cls, cores: list[EngineClient], config: EngineConfig) -> DataParallelClient:
        """Wait until every launched core has loaded the model; if one fails, all go down.
        `config`: the flags as this process resolved them (core 0's)."""
        waits = [
            asyncio.create_task(core.ready(config.for_core(i))) for i, core in enumerate(cores)
        ]
        try:
            await asyncio.gather(*waits)
        except BaseException:
            for task in waits:  # a wait that fails or is cancelled stops its core
                task.cancel()
            await asyncio.gather(*waits, return_exceptions=True)
            for core in cores:  # and the cores that were ready go down too
                with contextlib.suppress(Exception):
                    await core.shutdown()
            raise
        client = cls(cores)
        client._readers = [
            asyncio.create_task(client._read(i), name=f"engine-core-{i}-outputs")
            for i in range(len(cores))
        ]
        return client

    @property
    def kv_cache(self) -> KVCacheStats | None:
        """Every core's pool and counts, summed."""
        known = [kv for kv in self.kv_caches if kv is not None]
        return sum_stats(known) if known else None

    @property
    def is_alive(self) -> bool:
        return all(c.is_alive for c in self.clients)

    @property
    def dead_reason(self) -> str | None:
        for i, client in enumerate(self.clients):
            if (reason := client.dead_reason) is not None:
                return f"engine core {i}: {reason}"
        return None

    def add_request(self, request: EngineRequest) -> None:
        core = self.router.route(request.prompt_token_ids)
        self._owner[request.request_id] = core
        self.clients[core].add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        by_core: dict[int, list[str]] = {}
        for request_id in request_ids:
            if (core := self._owner.get(request_id)) is not None:
                by_core.setdefault(core, []).append(request_id)
        for core, ids in by_core.items():
            self.clients[core].abort_requests(ids)

    async def get_outputs(self) -> Outputs:
        if self._error is not None:
            raise self._error
        item = await self._queue.get()
        if isinstance(item, EngineDeadError):
            raise item
        return self._take(*item)

    def ready_outputs(self) -> list[Outputs]:
        """Every core's batches that have come in already, taken without waiting (a core's
        death ends the list: the next `get_outputs` raises it)."""
        batches = []
        while self._error is None and not self._queue.empty():
            item = self._queue.get_nowait()
            if isinstance(item, EngineDeadError):
                self._error = item
            else:
                batches.append(self._take(*item))
        return batches

    def _take(self, core: int, batch: Outputs) -> Outputs:
        self.kv_caches[core] = batch.kv_cache
        ended = [o.request_id for o in batch.outputs if o.finish_reason is not None]
        for request_id in [*ended, *(request_id for request_id, _ in batch.rejected)]:
            if self._owner.pop(request_id, None) is not None:
                self.router.finished(core)
        engines = [kv for kv in self.kv_caches if kv is not None]
        return msgspec.structs.replace(
            batch, kv_cache=sum_stats(engines), engine=core, engines=list(self.kv_caches)
        )

    async def _read(self, core: int) -> None:
        client = self.clients[core]
        try:
            while True:
                for batch in [await client.get_outputs(), *client.ready_outputs()]:
                    self._queue.put_nowait((core, batch))
        except EngineDeadError as e:
            self._queue.put_nowait(EngineDeadError(f"engine core {core}: {e}"))

    async def shutdown(self, timeout_s: float = 5.0) -> None:
        for task in self._readers:
            task.cancel()
        for task in self._readers:
            with contextlib.suppress(asyncio.CancelledError, EngineDeadError):
                await task
        await asyncio.gather(*(c.shutdown(timeout_s) for c in self.clients))


def sum_stats(stats: Sequence[KVCacheStats]) -> KVCacheStats:
    """Pools of the same block size as one: blocks, requests and counts added up (a device's
    memory is the first core's)."""
    first = stats[0]
    added = {
        f.name: sum(getattr(kv, f.name) for kv in stats)
        for f in msgspec.structs.fields(KVCacheStats)
        if f.name.startswith("num_")
    }
    swaps = [kv.swap for kv in stats if kv.swap is not None]
    specs = [kv.spec_decode for kv in stats if kv.spec_decode is not None]
    return msgspec.structs.replace(
        first, **added, swap=_sum_swap(swaps), spec_decode=_sum_spec(specs)
    )


def _sum_swap(swaps: list[SwapStats]) -> SwapStats | None:
    if not swaps:
        return None
    added = {
        f.name: sum(getattr(s, f.name) for s in swaps)
        for f in msgspec.structs.fields(SwapStats)
        if f.name not in ("bytes_per_block", "copy_bytes_per_s", "prefill_s_per_token")
    }
    return msgspec.structs.replace(swaps[0], **added)


def _sum_spec(specs: list[SpecDecodeStats]) -> SpecDecodeStats | None:
    if not specs:
        return None
    return SpecDecodeStats(
        sum(s.num_drafts for s in specs),
        sum(s.num_draft_tokens for s in specs),
        sum(s.num_accepted_tokens for s in specs),
        [sum(column) for column in zip(*(s.accepted_per_position for s in specs), strict=True)],
    )
