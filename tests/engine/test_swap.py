"""Swap to host: preempted requests' KV blocks copied out and back, driven by a scripted runner
that keeps what each device and host block slot holds.

The runner writes, for every token a step computes, a key naming that token and every token
before it in its sequence; before each chunk it checks that every earlier position of the
request's block table holds the right key. So a wrong swap pair, a block reused before its
copy, a cached prefix taken over a stale block or a lost position all fail here, before any
model runs (tests/entrypoints check the real copies against transformers).
"""

from __future__ import annotations

import random

import pytest

from metrale.config import SchedulerConfig
from metrale.engine.block_pool import BlockPool
from metrale.engine.core import EngineCore
from metrale.engine.kv_cache_manager import KVCacheManager
from metrale.engine.messages import FinishReason
from metrale.engine.request import Request, RequestStatus
from metrale.engine.scheduler import Scheduler
from metrale.engine.step import SchedulerOutput
from metrale.engine.swap_space import SwapCosts, SwapSpace
from metrale.engine_args import EngineArgs
from tests.engine.fake_runner import FakeRunner, scripted_token
from tests.engine.test_async_scheduling import run
from tests.engine.test_async_scheduling import workload as async_workload
from tests.engine.test_scheduler import BLOCK, expected_tokens, request

CHEAP_COPIES = SwapCosts(copy_bytes_per_s=1e12, prefill_s_per_token=1e-3)


class KVRunner(FakeRunner):
    """A FakeRunner that also keeps the KV pool's contents, device and host, as keys."""

    def __init__(self) -> None:
        super().__init__()
        self.device: dict[tuple[int, int], tuple[int, ...]] = {}
        self.host: dict[tuple[int, int], tuple[int, ...]] = {}
        self.copied_in = 0

    def launch(self, scheduled: SchedulerOutput) -> SchedulerOutput:
        for device_block, host_block in scheduled.swap_out:
            for slot in range(BLOCK):
                self.host[host_block, slot] = self.device.get((device_block, slot))
        for host_block, device_block in scheduled.swap_in:
            for slot in range(BLOCK):
                self.device[device_block, slot] = self.host.pop((host_block, slot))
            self.copied_in += 1
        # A layer stores the whole step's keys before any attention reads them: a prefix hit
        # may read a block that an earlier request's chunk in the same step fills.
        step = list(zip(scheduled.chunks, scheduled.requests, strict=True))
        for chunk, req in step:
            for pos in range(chunk.start_pos, chunk.start_pos + chunk.num_tokens):
                self.device[chunk.block_ids[pos // BLOCK], pos % BLOCK] = key(req, pos)
        for chunk, req in step:
            for pos in range(chunk.start_pos):
                held = self.device.get((chunk.block_ids[pos // BLOCK], pos % BLOCK))
                assert held == key(req, pos), f"{req.request_id}: position {pos} lost"
        return super().launch(scheduled)


def key(req: Request, position: int) -> tuple[int, ...]:
    """The tokens of `req` up to `position` (outputs are the scripted ones)."""
    prompt = req.prompt_token_ids
    outputs = [scripted_token(req.request_id, p) for p in range(len(prompt), position + 1)]
    return tuple(prompt[: position + 1]) + tuple(outputs)


def make_scheduler(num_blocks, num_host_blocks, mode="auto", **limits):
    config = SchedulerConfig(
        max_num_seqs=limits.get("max_num_seqs", 6),
        max_batch_size=limits.get("max_num_seqs", 6),
        max_prefill_tokens=limits.get("max_prefill_tokens", 64),
        max_num_batched_tokens=limits.get("max_prefill_tokens", 64) + 6,
        max_seq_len=256,
    )
    pool = BlockPool(num_blocks, enable_prefix_caching=limits.get("prefix_caching", True))
    swap = SwapSpace(num_host_blocks, bytes_per_block=1024, costs=CHEAP_COPIES, mode=mode)
    return Scheduler(config, KVCacheManager(pool, BLOCK), swap=swap)


@pytest.fixture(scope="module")
def configs(qwen3_dir):
    return {
        mode: EngineArgs(model_from_path=str(qwen3_dir), scheduler_config=mode).create_config()
        for mode in ("sync", "async")
    }


def workload(seed: int):
    """16 requests of up to 60 tokens: 15 blocks, all but one of the pool's."""
    return async_workload(seed, max_prompt_len=36, max_tokens=24)


@pytest.mark.parametrize("scheduling", ["sync", "async"])
@pytest.mark.parametrize("seed", range(4))
def test_a_swap_storm_keeps_every_position_and_gives_the_unpressured_tokens(
    configs, scheduling, seed
):
    rng = random.Random(seed)
    limits = dict(max_prefill_tokens=rng.choice([4, 8, 64]), prefix_caching=rng.random() < 0.5)
    # A host pool smaller than the storm needs: some victims are recomputed for want of room.
    scheduler = make_scheduler(num_blocks=16, num_host_blocks=rng.choice([6, 64]), **limits)
    runner = KVRunner()
    core = EngineCore(configs[scheduling], runner, scheduler)
    reqs = workload(seed)
    for r in reqs:
        scheduler.add_request(r)
    outputs, reasons = run(core)
    for r in reqs:
        assert outputs[r.request_id] == expected_tokens(r, r.sampling_params.max_tokens)
        assert reasons[r.request_id] is FinishReason.LENGTH
    assert scheduler.swap.num_swap_outs > 0 and runner.copied_in > 0
    assert scheduler.kv_cache.pool.num_free_blocks == 16
    assert scheduler.swap.num_free_blocks == scheduler.swap.num_blocks
    assert scheduler.swap.blocks_in + len(runner.host) // BLOCK <= scheduler.swap.blocks_out


@pytest.mark.parametrize("seed", range(3))
def test_aborts_of_swapped_requests_free_their_host_blocks(configs, seed):
    scheduler = make_scheduler(num_blocks=16, num_host_blocks=64, max_prefill_tokens=8)
    core = EngineCore(configs["async"], KVRunner(), scheduler)
    reqs = workload(seed)
    for r in reqs:
        scheduler.add_request(r)
    rng = random.Random(seed)
    aborted = 0
    for _ in range(10_000):
        if not core.has_unfinished_requests():
            break
        core.step()
        swapped = [r for r in scheduler.waiting if r.status is RequestStatus.SWAPPED]
        if swapped and rng.random() < 0.3:
            core.abort_request(swapped[0].request_id)
            aborted += 1
    assert aborted > 0
    assert scheduler.kv_cache.pool.num_free_blocks == 16
    assert scheduler.swap.num_free_blocks == scheduler.swap.num_blocks


def storm(mode: str = "auto", costs: SwapCosts = CHEAP_COPIES) -> Scheduler:
    """Four requests of 40 tokens (10 blocks) each through a pool of 16 blocks, to the end."""
    scheduler = make_scheduler(num_blocks=16, num_host_blocks=64, mode=mode)
    scheduler.swap.costs = costs
    for i in range(4):
        scheduler.add_request(request(f"r{i}", prompt_len=20, max_tokens=20, first_token=50 * i))
    runner = KVRunner()
    for _ in range(1000):
        if not scheduler.num_unfinished_requests:
            break
        scheduled = scheduler.schedule()
        scheduler.update(scheduled, runner.execute(scheduled))
    assert not scheduler.num_unfinished_requests
    assert scheduler.num_preemptions > 0
    return scheduler


def test_the_choice_follows_the_costs():
    assert storm().swap.num_swap_outs > 0
    # Copies slower than recomputing: every victim is recomputed, unless told to swap.
    slow = SwapCosts(copy_bytes_per_s=1e3, prefill_s_per_token=1e-6)
    assert storm(costs=slow).swap.num_swap_outs == 0
    assert storm("swap", costs=slow).swap.num_swap_outs > 0
    assert storm("recompute").swap.num_swap_outs == 0


def test_recomputed_tokens_are_counted_and_swaps_recompute_none():
    assert storm("recompute").num_recomputed_tokens > 0
    assert storm("swap").num_recomputed_tokens == 0
