"""The API process's side of the engine core: a cancellation during startup is never lost."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from metrale.engine.client import EngineClient
from metrale.engine_args import EngineArgs


def test_a_cancel_while_the_engine_readies_is_not_lost(qwen3_dir: Path):
    """Ctrl-C (or SIGTERM) during `met serve`'s startup cancels the main task wherever it runs;
    the cancellation lands at its next await, which is often `ready()` with READY already
    waiting (the engine loads while the API process imports). `ready()` must raise it then,
    not return READY and let the server start serving with the stop forgotten (Python 3.11's
    `asyncio.wait_for` returned a result that completed at the moment it was cancelled)."""
    config = EngineArgs(
        model_from_path=str(qwen3_dir), max_num_seqs=4, enforce_eager=True
    ).create_config()

    async def run() -> EngineClient:
        client = EngineClient.launch(config, in_process=True)
        # READY is in the socket before ready() reads (the engine runs in a thread here).
        assert client._arrived.poll(120_000), "the engine never said READY"
        task = asyncio.current_task()
        assert task is not None
        task.cancel()  # what Ctrl-C's handler does while startup's synchronous work runs
        with pytest.raises(asyncio.CancelledError):
            await client.ready(config)
        task.uncancel()
        return client

    client = asyncio.run(run())
    assert not client.is_alive  # ready() stopped the engine on its way out
