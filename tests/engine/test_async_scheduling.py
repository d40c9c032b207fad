"""Async scheduling: step N+1 is scheduled and launched before step N's tokens are back.

The engine core drives a scripted runner whose tokens depend on the request and position only,
so an async run must give exactly the sync run's tokens; the runner checks that every pending
input token is one it sampled the step before. The real model's side (the pending token read
from the device) is checked against transformers in tests/entrypoints.
"""

from __future__ import annotations

import random

import pytest

from metrale.engine.core import EngineCore
from metrale.engine.messages import FinishReason
from metrale.engine.step import PENDING_TOKEN_ID
from metrale.engine_args import EngineArgs
from metrale.sampling_params import StructuredOutput, ThinkingBudget
from tests.engine.fake_runner import FakeRunner
from tests.engine.test_scheduler import expected_tokens, make_scheduler, request


@pytest.fixture(scope="module")
def configs(qwen3_dir):
    return {
        mode: EngineArgs(model_from_path=str(qwen3_dir), scheduler_config=mode).create_config()
        for mode in ("sync", "async")
    }


def run(core: EngineCore, abort_rate: float = 0.0, rng: random.Random | None = None):
    outputs: dict[str, list[int]] = {}
    reasons = {}
    for _ in range(10_000):
        if not core.has_unfinished_requests():
            return outputs, reasons
        for out in core.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
        if rng is not None and rng.random() < abort_rate and core.scheduler.running:
            aborted = core.abort_request(core.scheduler.running[0].request_id)
            reasons[aborted.request_id] = aborted.finish_reason
    raise AssertionError("requests did not finish")


def engine(config, runner=None, **scheduler_kwargs) -> EngineCore:
    return EngineCore(config, runner or FakeRunner(), make_scheduler(**scheduler_kwargs))


def workload(seed: int, max_prompt_len: int = 30, max_tokens: int = 20):
    rng = random.Random(seed)
    return [
        request(
            f"r{i}",
            prompt_len=rng.randint(1, max_prompt_len),
            max_tokens=rng.randint(1, max_tokens),
            first_token=0 if rng.random() < 0.5 else 100 * i,  # half share a prefix
        )
        for i in range(16)
    ]


@pytest.mark.parametrize("seed", range(4))
def test_async_gives_the_sync_tokens_under_chunking_preemption_and_prefix_hits(configs, seed):
    limits = dict(
        num_blocks=24, max_num_seqs=6, max_prefill_tokens=random.Random(seed).choice([4, 8, 32])
    )
    results = {}
    for mode, config in configs.items():
        core = engine(config, **limits)
        for r in workload(seed):
            core.scheduler.add_request(r)
        results[mode] = run(core)
        assert core.scheduler.kv_cache.pool.num_free_blocks == 24
    assert results["async"] == results["sync"]
    for r in workload(seed):
        assert results["async"][0][r.request_id] == expected_tokens(r, r.sampling_params.max_tokens)


def test_decodes_feed_the_pending_token_and_a_request_at_its_length_sits_out(configs):
    runner = FakeRunner()
    core = engine(configs["async"], runner)
    core.scheduler.add_request(request("a", prompt_len=5, max_tokens=3))
    assert core.step() == [], "the first step's tokens are not back yet"
    first = core.step()  # launches the first decode, returns the prefill's sample
    assert [o.new_token_ids for o in first] == [expected_tokens(core.scheduler.requests["a"], 1)]
    (decode,) = runner.steps[1].chunks
    assert decode.token_ids == [PENDING_TOKEN_ID] and decode.start_pos == 5
    run(core)
    # Three tokens, three sampling steps: none was spent past max_tokens.
    assert [len(step.chunks) for step in runner.steps if step.chunks] == [1, 1, 1]


def test_a_stop_seen_late_drops_the_step_computed_after_it(configs):
    class EosRunner(FakeRunner):
        def collect(self, scheduled):
            out = super().collect(scheduled)
            return type(out)([1] * len(out.sampled_token_ids), out.logprobs)

    runner = EosRunner()
    core = engine(configs["async"], runner)
    core.scheduler.add_request(request("stops", max_tokens=5))
    core.scheduler.add_request(request("min", max_tokens=5, min_tokens=2))
    outputs, reasons = run(core)
    assert outputs == {"stops": [1], "min": [1, 1, 1]}
    assert reasons == {"stops": FinishReason.STOP, "min": FinishReason.STOP}
    # The step launched before the stop came back computed one more token for each; dropped.
    stops_chunks = [c for step in runner.steps for c in step.chunks if c.request_id == "stops"]
    assert len(stops_chunks) == 2
    banned = [c.banned_token_ids for s in runner.steps for c in s.chunks if c.request_id == "min"]
    assert banned == [(1,), (1,), (), ()], "min_tokens counts the pending tokens"
    assert core.scheduler.kv_cache.pool.num_used_blocks == 0


def test_an_aborted_request_gets_nothing_from_its_step_in_flight_even_under_a_reused_id(configs):
    core = engine(configs["async"])
    core.scheduler.add_request(request("a", prompt_len=6, max_tokens=8))
    core.step()
    core.step()  # a decode of "a" is in flight
    assert core.abort_request("a").finish_reason is FinishReason.ABORT
    again = request("a", prompt_len=9, max_tokens=4, first_token=50)
    core.scheduler.add_request(again)
    outputs, reasons = run(core)
    assert outputs["a"] == expected_tokens(again, 4) and reasons["a"] is FinishReason.LENGTH
    assert core.scheduler.kv_cache.pool.num_used_blocks == 0


@pytest.mark.parametrize("seed", range(3))
def test_aborts_at_random_keep_block_accounting_exact(configs, seed):
    core = engine(configs["async"], num_blocks=24, max_num_seqs=6, max_prefill_tokens=8)
    reqs = workload(seed)
    for r in reqs:
        core.scheduler.add_request(r)
    outputs, reasons = run(core, abort_rate=0.1, rng=random.Random(seed))
    assert set(reasons) == {r.request_id for r in reqs}
    for r in reqs:
        if reasons[r.request_id] is FinishReason.LENGTH:
            assert outputs[r.request_id] == expected_tokens(r, r.sampling_params.max_tokens)
    assert core.scheduler.kv_cache.pool.num_free_blocks == 24


@pytest.mark.parametrize(
    "params",
    [
        {"structured": StructuredOutput("regex", "[a-z]+")},
        {
            "thinking": ThinkingBudget(
                max_tokens=2, start_token_id=7, end_token_id=8, starts_inside=True
            )
        },
        {"frequency_penalty": 0.5, "dry_multiplier": 0.8},
    ],
    ids=["grammar", "thinking-budget", "penalties"],
)
def test_host_decided_requests_wait_for_their_tokens(configs, params):
    """A grammar and a thinking budget are decided on the host: their steps wait for the last
    token. Penalties read the history the device keeps: theirs go on with it pending."""
    runner = FakeRunner()
    core = engine(configs["async"], runner)
    core.scheduler.add_request(request("free", prompt_len=4, max_tokens=6))
    core.scheduler.add_request(request("host", prompt_len=4, max_tokens=6, **params))
    run(core)
    host_chunks = [c for s in runner.steps for c in s.chunks if c.request_id == "host"]
    pending = [c for c in host_chunks if PENDING_TOKEN_ID in c.token_ids]
    if "thinking" in params:
        # The first decode cannot spend the budget of 2, so it goes ahead on a pending token;
        # the second could, so it waits, and the close is forced right on time.
        assert len(pending) == 1 and PENDING_TOKEN_ID in host_chunks[1].token_ids
        assert [c.forced_token_id for c in host_chunks][:3] == [None, None, 8]
    elif "structured" in params:
        assert pending == []
    else:
        assert len(pending) == len(host_chunks) - 1  # every decode


def test_a_spent_thinking_budget_bans_opening_another_block(configs):
    runner = FakeRunner()
    core = engine(configs["async"], runner)
    budget = ThinkingBudget(max_tokens=0, start_token_id=7, end_token_id=8)
    core.scheduler.add_request(request("r", prompt_len=4, max_tokens=3, thinking=budget))
    run(core)
    assert all(7 in c.banned_token_ids for s in runner.steps for c in s.chunks)


def test_a_speculating_request_that_finds_no_drafts_stops_waiting(configs):
    """Each lookup waits for the step before (drafts need the last token); after the lookups
    that find nothing pause its drafting, its decodes go on with their token pending."""
    from metrale.engine.speculation.config import SpeculativeConfig
    from metrale.engine.speculation.speculator import ATTEMPTS, NgramSpeculator

    speculator = NgramSpeculator(SpeculativeConfig(), async_scheduling=True)
    runner = FakeRunner()
    core = engine(configs["async"], runner, speculator=speculator)
    # The prompt holds every token the script gives (3..99, in steps of 1); the script steps by
    # 7: each last token occurred before, so a match may follow, but no 2-gram ever repeats.
    req = request("spec", prompt_len=97, first_token=3, max_tokens=30)
    core.scheduler.add_request(req)
    outputs, _ = run(core)
    assert outputs["spec"] == expected_tokens(req, 30)
    chunks = [c for s in runner.steps for c in s.chunks]
    waited = [PENDING_TOKEN_ID not in c.token_ids for c in chunks if c.num_tokens == 1]
    # (not the first decode: it follows the prompt's last token, which occurred nowhere before)
    assert waited[1 : 1 + ATTEMPTS] == [True] * ATTEMPTS and not all(waited)
    assert req.draft_resume_at > 0 and speculator.stats.num_drafts == 0


def test_a_request_whose_tokens_cannot_match_next_never_waits(configs):
    """A lookup needs the last token to have occurred before (the default n-gram minimum is
    2): while it has not, whatever the pending token, nothing would be found, so the request
    decodes with its token pending and nothing is looked up."""
    from metrale.engine.speculation.config import SpeculativeConfig
    from metrale.engine.speculation.speculator import NgramSpeculator

    speculator = NgramSpeculator(SpeculativeConfig(), async_scheduling=True)
    runner = FakeRunner()
    core = engine(configs["async"], runner, speculator=speculator)
    req = request("spec", prompt_len=3, max_tokens=30)  # prompt 0 1 2; the script gives 3..99
    core.scheduler.add_request(req)
    outputs, _ = run(core)
    assert outputs["spec"] == expected_tokens(req, 30)
    assert len(set(outputs["spec"])) == 30  # no token repeats
    chunks = [c for s in runner.steps for c in s.chunks]
    assert all(PENDING_TOKEN_ID in c.token_ids for c in chunks[1:])  # never waited
    assert req.draft_resume_at == 0 and speculator.stats.num_drafts == 0


def test_a_request_whose_drafts_would_not_pay_never_waits(configs):
    """Priced out at this batch size (the cost model's bar above its acceptance), a speculating
    request decodes with its token pending from the start: drafts are not looked up, so there
    is nothing to wait for."""
    from metrale.engine.speculation.config import SpeculativeConfig
    from metrale.engine.speculation.cost_model import VerifyCosts
    from metrale.engine.speculation.speculator import NgramSpeculator

    dear = VerifyCosts(4, (1,), (0.010,), (0.040,))  # a draft must bring 0.75 tokens
    speculator = NgramSpeculator(SpeculativeConfig(), async_scheduling=True, costs=dear)
    runner = FakeRunner()
    core = engine(configs["async"], runner, speculator=speculator)
    req = request("spec", prompt_len=4, max_tokens=30)
    core.scheduler.add_request(req)
    outputs, _ = run(core)
    assert outputs["spec"] == expected_tokens(req, 30)
    chunks = [c for s in runner.steps for c in s.chunks]
    assert all(PENDING_TOKEN_ID in c.token_ids for c in chunks[1:])  # never waited
    assert speculator.num_priced_out == 0  # (never even looked: it had no tokens to look in)


def test_a_paused_speculating_request_still_waits_where_its_thinking_budget_may_end(configs):
    """Drafting paused, a thinking request still waits for its pending tokens when they may
    spend its budget: the close it forces is decided from them."""
    from metrale.engine.speculation.config import SpeculativeConfig
    from metrale.engine.speculation.speculator import NgramSpeculator

    speculator = NgramSpeculator(SpeculativeConfig(), async_scheduling=True)
    runner = FakeRunner()
    core = engine(configs["async"], runner, speculator=speculator)
    budget = ThinkingBudget(5, start_token_id=3, end_token_id=4, starts_inside=True)
    req = request("think", prompt_len=4, max_tokens=12, thinking=budget)
    req.draft_resume_at = 10**6  # paused for good
    core.scheduler.add_request(req)
    run(core)
    chunks = [c for s in runner.steps for c in s.chunks]  # chunk i samples output token i
    assert [c.forced_token_id for c in chunks][:6] == [None] * 5 + [4]  # closed on time
    assert PENDING_TOKEN_ID not in chunks[5].token_ids  # (it waited for the 5th)
