"""The figures the engine ships with its outputs: one `StepStats` per step the device ran, the
requests preempted while scheduling, and each request's milestones on its first output."""

from __future__ import annotations

import dataclasses

import pytest

from metrale.engine.core import EngineCore
from metrale.engine.messages import EngineRequest
from metrale.engine_args import EngineArgs
from metrale.sampling_params import SamplingParams
from tests.engine.fake_runner import FakeRunner
from tests.engine.test_scheduler import make_scheduler, request


@pytest.fixture(scope="module", params=["sync", "async"])
def config(qwen3_dir, request):
    return EngineArgs(
        model_from_path=str(qwen3_dir), scheduler_config=request.param
    ).create_config()


def drive(core: EngineCore, requests) -> tuple[list, dict]:
    for r in requests:
        core.scheduler.add_request(r)
    stats, firsts = [], {}
    while core.has_unfinished_requests():
        for out in core.step():
            if out.timing is not None:
                assert out.request_id not in firsts, "milestones come once, with the first"
                firsts[out.request_id] = out.timing
        stats.extend(core.step_stats)
        core.step_stats.clear()
    return stats, firsts


def test_each_device_step_is_counted_once_with_its_tokens(config):
    runner = FakeRunner()
    core = EngineCore(config, runner, make_scheduler(max_prefill_tokens=8))
    reqs = [request(f"r{i}", prompt_len=5 + 7 * i, max_tokens=6) for i in range(4)]
    stats, firsts = drive(core, reqs)
    non_empty = [s for s in runner.steps if s.chunks]
    assert [s.num_tokens for s in stats] == [s.num_tokens for s in non_empty]
    assert [s.num_requests for s in stats] == [len(s.chunks) for s in non_empty]
    assert all(s.host_s is not None and s.host_s >= 0 for s in stats)
    assert not any(s.cuda_graph for s in stats)
    # Every request's milestones are ordered; the prompt was chunked, so prefill took steps.
    assert set(firsts) == {r.request_id for r in reqs}
    for t in firsts.values():
        assert t.queued_s <= t.scheduled_s <= t.first_token_s


def test_preempted_requests_are_named_in_the_step_that_preempted_them(config):
    # 3 requests of up to 22 tokens (6 blocks each) in a pool of 12 blocks.
    core = EngineCore(config, FakeRunner(), make_scheduler(num_blocks=12))
    reqs = [request(f"r{i}", prompt_len=10, max_tokens=12, first_token=20 * i) for i in range(3)]
    stats, _ = drive(core, reqs)
    preempted = [rid for s in stats for rid in s.preempted]
    assert core.scheduler.num_preemptions > 0
    assert len(preempted) == core.scheduler.num_preemptions
    assert set(preempted) <= {r.request_id for r in reqs}


def test_an_abort_before_the_first_token_carries_the_milestones_it_reached(config):
    core = EngineCore(config, FakeRunner(), make_scheduler())
    core.scheduler.add_request(request("queued"))
    aborted = core.abort_request("queued")
    assert aborted.timing is not None and aborted.timing.scheduled_s is None


def test_disable_log_stats_collects_no_step_figures(qwen3_dir):
    config = EngineArgs(model_from_path=str(qwen3_dir), disable_log_stats=True).create_config()
    assert not config.log_stats
    core = EngineCore(config, FakeRunner(), make_scheduler(max_prefill_tokens=8))
    reqs = [request(f"r{i}", prompt_len=9, max_tokens=4) for i in range(3)]
    stats, firsts = drive(core, reqs)
    assert stats == []
    assert set(firsts) == {r.request_id for r in reqs}  # each request's milestones still come


def test_a_runner_without_step_timing_measures_no_device_time(qwen3_dir):
    config = EngineArgs(model_from_path=str(qwen3_dir), disable_log_stats=True).create_config()
    request = EngineRequest("a", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True), 0.0)
    core = EngineCore.from_config(config, progress=False)
    assert core.runner.time_steps is False
    core.add_request(request)
    while core.has_unfinished_requests():
        core.step()
    assert list(core.step_stats) == []
    timed = EngineCore.from_config(dataclasses.replace(config, log_stats=True), progress=False)
    timed.add_request(request)
    while timed.has_unfinished_requests():
        timed.step()
    assert all(s.device_s is not None and s.device_s >= 0 for s in timed.step_stats)
    assert len(timed.step_stats) == 3  # a prefill and two decodes


def test_the_device_memory_sent_each_step_is_read_once_a_period(config):
    from metrale.engine.stats import DeviceMemoryReader, kv_cache_stats

    core = EngineCore(config, FakeRunner(), make_scheduler())
    now = [5.0]
    reader = DeviceMemoryReader(core, period_s=1.0, clock=lambda: now[0])
    first = reader.read()
    assert first.device == str(config.device)
    now[0] = 5.99
    assert reader.read() is first
    assert kv_cache_stats(core, reader.read()).memory is first
    now[0] = 6.0
    assert reader.read() is not first
