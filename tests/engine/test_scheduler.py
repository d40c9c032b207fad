"""Scheduler and KV-manager behaviour, driven by a scripted runner (no model, milliseconds)."""

from __future__ import annotations

import pytest

from metrale.config import SchedulerConfig
from metrale.engine.block_pool import BlockPool
from metrale.engine.kv_cache_manager import KVCacheManager
from metrale.engine.messages import FinishReason
from metrale.engine.request import Request
from metrale.engine.scheduler import Scheduler
from metrale.sampling_params import SamplingParams
from tests.engine.fake_runner import FakeRunner, scripted_token

BLOCK = 4


def make_scheduler(
    num_blocks=64,
    max_num_seqs=8,
    max_batch_size=None,
    max_prefill_tokens=64,
    max_num_batched_tokens=None,
    max_seq_len=256,
    prefix_caching=True,
    speculator=None,
):
    max_batch_size = max_batch_size or max_num_seqs
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_batch_size=max_batch_size,
        max_prefill_tokens=max_prefill_tokens,
        max_num_batched_tokens=max_num_batched_tokens or max_prefill_tokens + max_batch_size,
        max_seq_len=max_seq_len,
    )
    pool = BlockPool(num_blocks, enable_prefix_caching=prefix_caching)
    return Scheduler(config, KVCacheManager(pool, BLOCK), speculator=speculator)


def request(rid, prompt_len=10, max_tokens=5, first_token=0, **params):
    prompt = [first_token + i for i in range(prompt_len)]
    return Request(
        rid,
        prompt,
        SamplingParams(temperature=0, max_tokens=max_tokens, **params),
        eos_token_ids=(1,),
    )


def run_to_completion(scheduler, runner=None, max_steps=10_000):
    runner = runner or FakeRunner()
    outputs: dict[str, list[int]] = {}
    reasons = {}
    for _ in range(max_steps):
        if not scheduler.num_unfinished_requests:
            break
        scheduled = scheduler.schedule()
        for out in scheduler.update(scheduled, runner.execute(scheduled)):
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    else:
        raise AssertionError("requests did not finish")
    return outputs, reasons, runner


def expected_tokens(req: Request, n: int) -> list[int]:
    return [scripted_token(req.request_id, req.num_prompt_tokens + i) for i in range(n)]


def test_all_blocks_free_after_requests_end():
    s = make_scheduler()
    reqs = [request(f"r{i}", prompt_len=3 + 5 * i, max_tokens=4 + i) for i in range(6)]
    for r in reqs:
        s.add_request(r)
    outputs, reasons, _ = run_to_completion(s)
    for r in reqs:
        assert outputs[r.request_id] == expected_tokens(r, r.sampling_params.max_tokens)
        assert reasons[r.request_id] is FinishReason.LENGTH
    assert s.kv_cache.pool.num_free_blocks == s.kv_cache.pool.num_blocks
    assert s.kv_cache._blocks == {} and s.kv_cache._hashes == {}


def test_chunked_prefill_respects_the_prefill_budget():
    s = make_scheduler(max_prefill_tokens=8, max_num_batched_tokens=12)
    long = request("long", prompt_len=30, max_tokens=3)
    s.add_request(long)
    outputs, _, runner = run_to_completion(s)
    prefill_sizes = [c.num_tokens for step in runner.steps for c in step.chunks]
    assert prefill_sizes[:4] == [8, 8, 8, 6], "30 prompt tokens in chunks of at most 8"
    assert [c.samples for step in runner.steps[:4] for c in step.chunks] == [False] * 3 + [True]
    assert outputs["long"] == expected_tokens(long, 3)


def test_token_budget_caps_each_step():
    s = make_scheduler(max_prefill_tokens=16, max_num_batched_tokens=20)
    for i in range(4):
        s.add_request(request(f"r{i}", prompt_len=12, max_tokens=6))
    _, _, runner = run_to_completion(s)
    assert all(step.num_tokens <= 20 for step in runner.steps)
    assert all(
        sum(c.num_tokens for c in step.chunks if c.num_tokens > 1) <= 16 for step in runner.steps
    )


def test_one_token_chunks_lead_each_step_in_their_order():
    """Decodes first (attention runs them as one decode batch), and every token still reaches
    its own request."""
    s = make_scheduler(max_prefill_tokens=8, max_num_batched_tokens=16)
    # One-token prompts are admitted after the chunks of running prompts: they move up.
    lens = [20, 1, 9, 1, 14]
    reqs = [request(f"r{i}", prompt_len=n, max_tokens=6, first_token=i) for i, n in enumerate(lens)]
    for r in reqs:
        s.add_request(r)
    outputs, _, runner = run_to_completion(s)
    mixed = 0
    for step in runner.steps:
        sizes = [c.num_tokens for c in step.chunks]
        num_decodes = next((i for i, n in enumerate(sizes) if n > 1), len(sizes))
        assert all(n > 1 for n in sizes[num_decodes:])
        decode_ids = [c.request_id for c in step.chunks[:num_decodes]]
        assert decode_ids == sorted(decode_ids), "decodes keep the running order (oldest first)"
        mixed += 0 < num_decodes < len(sizes)
    assert mixed > 0
    for r in reqs:
        assert outputs[r.request_id] == expected_tokens(r, 6)


def test_max_num_seqs_and_batch_size_bound_each_step():
    s = make_scheduler(max_num_seqs=3, max_batch_size=2)
    for i in range(5):
        s.add_request(request(f"r{i}", prompt_len=4, max_tokens=3))
    _, _, runner = run_to_completion(s)
    assert max(len(step.chunks) for step in runner.steps) == 2


def test_preemption_when_pool_runs_dry_then_everything_completes():
    # 3 requests of up to 10 + 12 tokens (6 blocks each) in a pool of 12 blocks.
    s = make_scheduler(num_blocks=12)
    reqs = [request(f"r{i}", prompt_len=10, max_tokens=12, first_token=20 * i) for i in range(3)]
    for r in reqs:
        s.add_request(r)
    outputs, _, _runner = run_to_completion(s)
    assert s.num_preemptions > 0
    for r in reqs:
        assert outputs[r.request_id] == expected_tokens(r, 12), "recompute loses no token"
    assert s.kv_cache.pool.num_free_blocks == 12


def test_newest_request_is_preempted_first():
    s = make_scheduler(num_blocks=7)
    old, new = request("old", prompt_len=8, max_tokens=20), request("new", 8, 20, first_token=50)
    s.add_request(old)
    scheduled = s.schedule()
    s.update(scheduled, FakeRunner().execute(scheduled))
    s.add_request(new)
    runner = FakeRunner()
    while new.num_preemptions == 0 and old.num_preemptions == 0:
        scheduled = s.schedule()
        s.update(scheduled, runner.execute(scheduled))
    assert new.num_preemptions == 1 and old.num_preemptions == 0


def test_prefix_cache_hits_are_counted_and_skip_compute():
    s = make_scheduler()
    first = request("a", prompt_len=18, max_tokens=2)
    s.add_request(first)
    run_to_completion(s)
    second = request("b", prompt_len=18, max_tokens=2)  # same prompt tokens
    s.add_request(second)
    _, _, runner = run_to_completion(s)
    first_chunk = runner.steps[0].chunks[0]
    assert first_chunk.start_pos == 16, "four full blocks of four came from the cache"
    assert second.num_cached_prompt_tokens == 16
    assert s.kv_cache.stats.num_hit_tokens == 16
    assert s.kv_cache.stats.num_queried_tokens == 36


def test_full_prompt_hit_still_computes_the_last_token():
    s = make_scheduler()
    s.add_request(request("a", prompt_len=16, max_tokens=1))
    run_to_completion(s)
    s.add_request(request("b", prompt_len=16, max_tokens=1))
    _, _, runner = run_to_completion(s)
    chunk = runner.steps[0].chunks[0]
    assert chunk.start_pos == 12 and chunk.num_tokens == 4


def test_shared_cached_block_is_not_freed_while_held():
    s = make_scheduler(num_blocks=16)
    a, b = request("a", prompt_len=9, max_tokens=8), request("b", prompt_len=9, max_tokens=8)
    s.add_request(a)
    scheduled = s.schedule()
    s.update(scheduled, FakeRunner().execute(scheduled))
    s.add_request(b)
    _outputs, _, _ = run_to_completion(s)
    assert b.num_cached_prompt_tokens == 8
    assert s.kv_cache.pool.num_free_blocks == 16


def test_eos_stops_unless_ignored_and_min_tokens_bans_it():
    class EosRunner(FakeRunner):
        def collect(self, scheduled):
            out = super().collect(scheduled)
            return type(out)([1] * len(out.sampled_token_ids), out.logprobs)

    s = make_scheduler()
    s.add_request(request("stops", max_tokens=5))
    s.add_request(request("ignores", max_tokens=5, ignore_eos=True))
    s.add_request(request("min", max_tokens=5, min_tokens=3))
    runner = EosRunner()
    outputs, reasons, _ = run_to_completion(s, runner)
    assert outputs["stops"] == [1] and reasons["stops"] is FinishReason.STOP
    assert len(outputs["ignores"]) == 5 and reasons["ignores"] is FinishReason.LENGTH
    assert len(outputs["min"]) == 4 and reasons["min"] is FinishReason.STOP
    banned = [
        c.banned_token_ids for step in runner.steps for c in step.chunks if c.request_id == "min"
    ]
    assert banned[:3] == [(1,)] * 3 and banned[3] == ()


def test_stop_token_ids_and_max_seq_len():
    s = make_scheduler(max_seq_len=14)
    s.add_request(request("cap", prompt_len=10, max_tokens=50))
    outputs, reasons, _ = run_to_completion(s)
    assert len(outputs["cap"]) == 4 and reasons["cap"] is FinishReason.LENGTH

    r = request("stop", max_tokens=50)
    stop_at = expected_tokens(r, 3)[2]
    s.add_request(request("stop", max_tokens=50, stop_token_ids=[stop_at]))
    outputs, reasons, _ = run_to_completion(s)
    assert outputs["stop"][-1] == stop_at and reasons["stop"] is FinishReason.STOP


def test_abort_frees_blocks_of_running_and_waiting_requests():
    s = make_scheduler(max_num_seqs=1)
    s.add_request(request("running", max_tokens=50))
    s.add_request(request("waiting", max_tokens=50))
    scheduled = s.schedule()
    s.update(scheduled, FakeRunner().execute(scheduled))
    assert s.kv_cache.pool.num_used_blocks > 0
    assert s.abort_request("running").finish_reason is FinishReason.ABORT
    assert s.abort_request("waiting").finish_reason is FinishReason.ABORT
    assert s.abort_request("unknown") is None
    assert s.kv_cache.pool.num_used_blocks == 0
    assert s.schedule().finished_request_ids == ["running", "waiting"]


@pytest.mark.parametrize("seed", range(5))
def test_random_workload_keeps_block_accounting_exact(seed):
    import random

    rng = random.Random(seed)
    s = make_scheduler(num_blocks=24, max_num_seqs=6, max_prefill_tokens=rng.choice([4, 8, 32]))
    reqs = []
    for i in range(20):
        shared = rng.random() < 0.5
        r = request(
            f"r{i}",
            prompt_len=rng.randint(1, 30),
            max_tokens=rng.randint(1, 20),
            first_token=0 if shared else 100 * i,
        )
        reqs.append(r)
        s.add_request(r)
    runner = FakeRunner()
    outputs: dict[str, list[int]] = {}
    while s.num_unfinished_requests:
        scheduled = s.schedule()
        held = sum(b.ref_count for b in s.kv_cache.pool.blocks)
        assert held == sum(len(v) for v in s.kv_cache._blocks.values())
        for chunk in scheduled.chunks:  # exactly the blocks the step's tokens need, no more
            assert len(chunk.block_ids) == -(-(chunk.start_pos + chunk.num_tokens) // BLOCK)
        for out in s.update(scheduled, runner.execute(scheduled)):
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        if rng.random() < 0.05 and s.running:
            s.abort_request(s.running[0].request_id)
    for r in reqs:
        if r.finish_reason is FinishReason.LENGTH:
            assert outputs[r.request_id] == expected_tokens(r, r.sampling_params.max_tokens)
    assert s.kv_cache.pool.num_free_blocks == 24


def test_prefix_stats_count_each_prompt_once_however_long_it_waits():
    s = make_scheduler(num_blocks=4)
    s.add_request(request("first", prompt_len=10, max_tokens=6))  # grows to fill all 4 blocks
    s.add_request(request("waits", prompt_len=7, max_tokens=2))  # no room for several steps
    run_to_completion(s)
    assert s.kv_cache.stats.num_queried_tokens == 17
