"""The scheduling policies (fifo, priority, slai) in the scheduler, on a fake clock with a
scripted runner: who is admitted first, who is preempted, when slai holds new prompts back, how
it sizes each step's prefill to the deadline from the step times it has seen, and that every
policy still finishes every request with its scripted tokens and frees every block."""

from __future__ import annotations

import pytest

from metrale.config import SchedulerConfig
from metrale.engine.block_pool import BlockPool
from metrale.engine.kv_cache_manager import KVCacheManager
from metrale.engine.request import Request
from metrale.engine.scheduler import Scheduler
from metrale.engine.step_time import StepTimeModel, chunk_pairs, prefill_work
from metrale.sampling_params import SamplingParams
from tests.engine.fake_runner import FakeRunner
from tests.engine.test_scheduler import expected_tokens, run_to_completion

BLOCK = 4


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(
    policy="fifo",
    *,
    num_blocks=64,
    max_num_seqs=8,
    max_prefill_tokens=64,
    deadline=None,
    max_seq_len=256,
):
    clock = FakeClock()
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_batch_size=max_num_seqs,
        max_prefill_tokens=max_prefill_tokens,
        max_num_batched_tokens=max_prefill_tokens + max_num_seqs,
        max_seq_len=max_seq_len,
        policy=policy,
        tbt_deadline_ms=deadline,
    )
    pool = BlockPool(num_blocks, enable_prefix_caching=False)
    return Scheduler(config, KVCacheManager(pool, BLOCK), clock=clock), clock


def req(rid, prompt_len=8, max_tokens=4, *, arrival=0.0, priority=0):
    return Request(
        rid,
        [2 + (i % 50) for i in range(prompt_len)],
        SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
        eos_token_ids=(1,),
        arrival_time_s=arrival,
        priority=priority,
    )


def admitted(scheduler) -> list[str]:
    """The requests the next step admits (a chunk for a request that was waiting)."""
    waiting = {r.request_id for r in scheduler.waiting}
    out = scheduler.schedule()
    scheduler.update(out, FakeRunner().execute(out))
    return [r.request_id for r in out.requests if r.request_id in waiting]


def test_fifo_admits_in_arrival_order_until_the_prefill_budget_is_spent():
    s, _ = make(max_prefill_tokens=20)
    for i, n in enumerate((8, 16, 4)):
        s.add_request(req(f"r{i}", n, arrival=i))
    assert admitted(s) == ["r0", "r1"]  # r1 gets a 12-token chunk; r2, shorter, waits behind
    assert [r.request_id for r in s.waiting] == ["r2"]


def test_priority_admits_the_lowest_value_first_then_by_arrival():
    s, _ = make("priority", max_num_seqs=2)
    for rid, priority, arrival in (("late-urgent", -5, 3.0), ("a", 0, 1.0), ("b", 0, 2.0)):
        s.add_request(req(rid, arrival=arrival, priority=priority))
    s.add_request(req("background", arrival=0.5, priority=10))
    assert admitted(s) == ["late-urgent", "a"]  # two seats: the rest wait in order
    assert [r.request_id for r in sorted(s.waiting, key=lambda r: r.arrival_time_s)] == [
        "background",
        "b",
    ]


def test_priority_preempts_the_highest_value_and_fifo_the_newest():
    """Three running requests, a pool with room for no more growth: the first to need a new
    block forces a victim among those not yet scheduled in the step."""
    for policy, victim in (("fifo", "c"), ("priority", "b")):
        s, _ = make(policy, num_blocks=6)  # 2 blocks each for prompts of 8 tokens
        for rid, priority, arrival in (("a", 0, 1.0), ("b", 9, 2.0), ("c", 1, 3.0)):
            s.add_request(req(rid, prompt_len=8, max_tokens=8, arrival=arrival, priority=priority))
        assert sorted(admitted(s)) == ["a", "b", "c"]  # prefill: 6 blocks taken
        out = s.schedule()  # each decode needs a third block: someone must yield
        assert s.preempted_ids == [victim], policy
        s.update(out, FakeRunner().execute(out))


def test_slai_holds_new_prompts_while_a_running_request_nears_its_deadline():
    s, clock = make("slai", deadline=100)
    s.add_request(req("running", max_tokens=50))
    assert admitted(s) == ["running"]  # its prefill gives it a first token at t=100
    s.add_request(req("new"))
    clock.now += 0.0625  # 62.5 ms since its last token: under 80% of 100 ms
    assert admitted(s) == ["new"]
    s.add_request(req("newer"))
    clock.now += 0.09375  # 93.75 ms since the step before gave "running" a token
    out = s.schedule()
    assert [r.request_id for r in out.requests] == ["running", "new"]  # decodes only
    s.update(out, FakeRunner().execute(out))
    assert admitted(s) == ["newer"]  # the decode just gave it a token at this time


def test_slai_admits_the_front_first_then_the_shortest_prompts():
    s, _ = make("slai", deadline=100, max_prefill_tokens=36)
    for rid, n, arrival in (("front", 24, 1.0), ("long", 12, 2.0), ("short", 4, 3.0)):
        s.add_request(req(rid, n, arrival=arrival))
    s.add_request(req("mid", 8, arrival=4.0))
    # the front's 24, then the shortest: 4 and 8 spend the 36; "long" (12) waits (fifo would
    # have given it the 12 after the front, and left the shorter two waiting)
    assert admitted(s) == ["front", "short", "mid"]
    assert [r.request_id for r in s.waiting] == ["long"]


@pytest.mark.parametrize("policy", ["fifo", "priority", "slai"])
def test_every_policy_finishes_every_request_with_its_tokens_under_preemption(policy):
    s, clock = make(policy, num_blocks=14, deadline=50 if policy == "slai" else None)
    reqs = [
        req(f"r{i}", prompt_len=5 + 3 * i, max_tokens=6 + i, arrival=i, priority=i % 3)
        for i in range(8)
    ]
    for r in reqs:
        s.add_request(r)

    class TickingRunner(FakeRunner):
        def execute(self, scheduled):
            clock.now += 0.03  # each step takes 30 ms: slai sees requests near the deadline
            return super().execute(scheduled)

    outputs, _, _ = run_to_completion(s, TickingRunner())
    for r in reqs:
        assert outputs[r.request_id] == expected_tokens(r, r.sampling_params.max_tokens)
    assert s.num_preemptions > 0  # the pool was small enough to force preemption
    assert s.kv_cache.pool.num_free_blocks == s.kv_cache.pool.num_blocks


@pytest.mark.parametrize(
    ("policy", "deadline", "problem"),
    [
        ("slai", None, "needs --tbt-deadline-ms"),
        ("slai", 0, "must be > 0"),
        ("lifo", None, "use one of fifo, priority, slai"),
    ],
)
def test_bad_policies_are_config_errors(policy, deadline, problem):
    with pytest.raises(ValueError, match=problem):
        make(policy, deadline=deadline)


def test_a_request_past_its_deadline_is_aborted_at_the_next_step_even_after_preemption():
    """The engine's own --request-timeout: the deadline travels with the request through a
    preemption and ends it wherever it is (running or waiting), its blocks freed."""
    s, clock = make(num_blocks=6)
    timed = req("timed", prompt_len=8, max_tokens=8, arrival=2.0)
    timed.deadline_s = clock.now + 1.0
    for r in (req("a", 8, 8, arrival=0.0), req("b", 8, 8, arrival=1.0), timed):
        s.add_request(r)
    assert sorted(admitted(s)) == ["a", "b", "timed"]
    out = s.schedule()  # the pool is full: the newest, "timed", is preempted
    s.update(out, FakeRunner().execute(out))
    assert s.preempted_ids == ["timed"] and s.expire() == []  # not yet due
    clock.now += 1.0  # exactly at its deadline, waiting to be recomputed
    (expired,) = s.expire()
    assert expired.request_id == "timed" and expired.finish_reason.value == "abort"
    assert "timed" not in s.requests and s.expire() == []
    outputs, _, _ = run_to_completion(s)
    assert set(outputs) == {"a", "b"}
    assert s.kv_cache.pool.num_free_blocks == s.kv_cache.pool.num_blocks


def test_a_running_request_past_its_deadline_is_aborted_and_its_blocks_freed():
    s, clock = make()
    late = req("late", max_tokens=50)
    late.deadline_s = clock.now + 0.25
    s.add_request(late)
    s.add_request(req("other", max_tokens=4))
    assert sorted(admitted(s)) == ["late", "other"]
    clock.now += 0.25
    assert [o.request_id for o in s.expire()] == ["late"]
    outputs, _, _ = run_to_completion(s)
    assert list(outputs) == ["other"]
    assert s.kv_cache.pool.num_free_blocks == s.kv_cache.pool.num_blocks


def test_slai_also_holds_the_next_chunk_of_a_prompt_being_prefilled():
    s, clock = make("slai", deadline=100, max_prefill_tokens=16)
    s.add_request(req("decoding", prompt_len=8, max_tokens=50))
    assert admitted(s) == ["decoding"]
    s.add_request(req("long", prompt_len=64))
    assert admitted(s) == ["long"]  # its first 16-token chunk, beside the decode
    clock.now += 0.09375  # the decode's token is 93.75 ms old: over 80% of the deadline
    out = s.schedule()
    assert [
        (r.request_id, c.num_tokens) for r, c in zip(out.requests, out.chunks, strict=True)
    ] == [("decoding", 1)]
    s.update(out, FakeRunner().execute(out))
    out = s.schedule()  # the decode just got its token: the prefill goes on
    assert sorted(r.request_id for r in out.requests) == ["decoding", "long"]
    s.update(out, FakeRunner().execute(out))


def _observe(model, start, n, seconds):
    model.observe(*prefill_work([(start, n)] if n else []), seconds)


def test_the_step_time_model_learns_base_and_per_token_cost():
    model = StepTimeModel()
    for _ in range(5):
        _observe(model, 0, 0, 0.010)
    assert model.coefficients is None  # no step prefilled
    for n in (512, 0, 1024, 0, 256):
        _observe(model, 0, n, 0.010 + 2e-5 * n)
    base, per_token, per_pair = model.coefficients
    assert base == pytest.approx(0.010) and per_token == pytest.approx(2e-5)
    assert per_pair == pytest.approx(0, abs=1e-9)
    assert model.tokens_within(0.030, 0) in (1499, 1500)  # float rounding either side
    assert model.tokens_within(-0.005, 0) == 0
    for n in [512, 1024] * 200:  # the batch grew: steps now take 20 ms more; old steps fade
        _observe(model, 0, n, 0.030 + 2e-5 * n)
    assert model.coefficients[0] == pytest.approx(0.030, rel=1e-3)


def test_a_late_chunk_of_a_long_prompt_costs_more():
    """Attention makes a chunk's cost grow with its start: the model fits both terms and sizes
    a chunk from its start."""
    model = StepTimeModel()
    per_token, per_pair = 2e-5, 1e-5  # per 1K-context token
    for start, n in [(0, 1024), (1024, 1024), (2048, 512), (0, 0), (2560, 1536), (0, 700)] * 5:
        _observe(model, start, n, 0.025 + per_token * n + per_pair * chunk_pairs(start, n))
    assert model.coefficients == pytest.approx((0.025, per_token, per_pair))
    early, late = model.tokens_within(0.011, 0), model.tokens_within(0.011, 3000)
    assert late < early
    for start, n in ((0, early), (3000, late)):
        assert model.seconds(start, n) <= 0.011 < model.seconds(start, n + 1)


def test_a_step_that_prefills_has_its_own_base():
    """On a GPU decode-only steps replay a graph and steps that prefill launch eagerly: the
    latter's fixed cost is theirs, not the decodes'."""
    model = StepTimeModel()
    for n in [0, 0, 500, 0, 0, 1500] * 10:
        _observe(model, 0, n, 0.0066 if n == 0 else 0.025 + 2e-5 * n)
    assert model.coefficients[:2] == pytest.approx((0.025, 2e-5))


def test_steps_of_one_prefill_size_are_anchored_by_the_decodes():
    model = StepTimeModel()
    _observe(model, 0, 240, 0.058)
    assert model.coefficients is None  # one point: no slope
    _observe(model, 0, 0, 0.010)
    assert model.coefficients == pytest.approx((0.010, 2e-4, 0.0))


def _step_times(policy: str) -> tuple[list[tuple[int, float]], Scheduler]:
    """Four decodes and six 480-token prompts arriving, under a 50 ms deadline, where a step
    takes 10 ms, plus 0.1 ms a prompt token and 0.1 ms per 1K attention pairs of its chunks:
    (prefill tokens, seconds) of each step."""
    s, clock = make(
        policy,
        num_blocks=512,
        max_prefill_tokens=512,
        deadline=50 if policy == "slai" else None,
        max_seq_len=512,
    )
    decodes = [req(f"d{i}", prompt_len=8, max_tokens=120) for i in range(4)]
    prompts = [req(f"p{i}", prompt_len=480, max_tokens=4) for i in range(6)]
    for r in decodes:
        s.add_request(r)
    steps: list[tuple[int, float]] = []

    class TimedRunner(FakeRunner):
        def execute(self, scheduled):
            tokens, pairs = prefill_work(
                (c.start_pos, c.num_tokens) for c in scheduled.chunks if c.num_tokens > 1
            )
            seconds = 0.010 + 1e-4 * tokens + 1e-4 * pairs
            clock.now += seconds
            steps.append((tokens, seconds))
            arriving = len(steps) // 12 - 1
            if len(steps) % 12 == 0 and arriving < len(prompts):
                s.add_request(prompts[arriving])
            return super().execute(scheduled)

    run_to_completion(s, TimedRunner())
    return steps, s


def test_slai_sizes_each_prefill_to_keep_steps_within_the_deadline():
    fifo, _ = _step_times("fifo")
    assert max(t for _, t in fifo) > 0.050  # a whole 480-token prompt in one step: 69 ms
    steps, s = _step_times("slai")
    # the first step prefills the decodes' prompts, nothing to decode beside them
    mixed = [(p, t) for p, t in steps[1:] if p > 0]
    assert len(mixed) > 10
    # the first prompt that arrives is prefilled whole, by --max-prefill-tokens (nothing learned
    # yet); the rest in chunks (about 265 tokens from the start of a prompt, 215 after them)
    # that keep each step within 80% of the deadline, 40 ms, once the model has seen enough
    # steps to tell its three terms apart
    assert mixed[0] == (480, pytest.approx(0.010 + 0.048 + 1e-4 * chunk_pairs(0, 480)))
    assert all(t <= 0.040 + 1e-9 for _, t in mixed[3:])
    assert max(t for _, t in mixed[3:]) > 0.039  # and not much shorter than that
    assert s.kv_cache.pool.num_free_blocks == s.kv_cache.pool.num_blocks
    assert not s.requests  # every request finished
