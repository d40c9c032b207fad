"""When drafts pay: the bar a request's acceptance must clear at each batch size, from a verify
step's cost against a plain decode's, and the speculator holding a request's drafts back where
they would not pay."""

from __future__ import annotations

import time

import pytest

from metrale.engine.request import Request
from metrale.engine.speculation.config import SpeculativeConfig
from metrale.engine.speculation.cost_model import VerifyCosts
from metrale.engine.speculation.speculator import NgramSpeculator
from metrale.sampling_params import SamplingParams

# A GPU-like table: at batch 1 four drafts cost 4% more than a plain decode; at 64, 3x.
COSTS = VerifyCosts(4, (1, 2, 4, 64), (0.010, 0.010, 0.011, 0.020), (0.0104, 0.011, 0.013, 0.060))


def test_the_bar_is_the_verify_steps_extra_time_per_draft():
    assert COSTS.min_acceptance(1) == pytest.approx(0.04 / 4)
    assert COSTS.min_acceptance(64) == pytest.approx(2.0 / 4)
    # between measured sizes, the times are interpolated: at 34, halfway from 4 to 64
    assert COSTS.min_acceptance(34) == pytest.approx((0.0365 / 0.0155 - 1) / 4)
    # past the largest measured, its bar; never below 0 (a verify step measured faster)
    assert COSTS.min_acceptance(500) == COSTS.min_acceptance(64)
    assert VerifyCosts(4, (1,), (0.010,), (0.009,)).min_acceptance(1) == 0.0


def test_measuring_stops_once_its_time_is_spent():
    calls = []

    def step_s(num_seqs: int, num_drafts: int) -> float:
        calls.append((num_seqs, num_drafts))
        time.sleep(0.02)
        return 0.001 * num_seqs * (1 + num_drafts)

    costs = VerifyCosts.measure(3, 48, step_s, budget_s=0.1)
    assert costs.batch_sizes[0] == 1 and len(costs.batch_sizes) < 7
    assert calls[:4] == [(1, 0), (1, 3), (2, 0), (2, 3)]
    full = VerifyCosts.measure(3, 48, lambda b, k: 0.001 * b * (1 + k), budget_s=10)
    assert full.batch_sizes == (1, 2, 4, 8, 16, 32, 48)
    assert full.min_acceptance(48) == pytest.approx(1.0)  # 4x the tokens, 4x the time


def repeating_request(request_id: str) -> Request:
    request = Request(request_id, [5, 6, 7, 8] * 6, SamplingParams(temperature=0.0))
    request.speculates = True
    return request


def test_drafts_are_held_back_where_the_requests_acceptance_does_not_pay():
    speculator = NgramSpeculator(SpeculativeConfig(num_speculative_tokens=4), costs=COSTS)
    request = repeating_request("r")
    # Before any check, its acceptance is the prior (0.5): it drafts at batch 1 and 4 ...
    assert speculator.propose(request, 4, num_seqs=1) == [5, 6, 7, 8]
    assert speculator.propose(request, 4, num_seqs=4) == [5, 6, 7, 8]
    # ... but not at 64, where only drafts accepted 2 times in 4 pay (and 0.5 is not above it).
    speculator.costs = VerifyCosts(4, (64,), (0.020,), (0.0601,))
    assert speculator.propose(request, 4, num_seqs=64) == []
    assert speculator.num_priced_out == 1
    speculator.costs = COSTS
    # Its drafts were all accepted lately: now they pay at 64 too.
    for _ in range(3):
        speculator.record(request, 4, 4)
    assert speculator.propose(request, 4, num_seqs=64) == [5, 6, 7, 8]
    # Rejected lately: held back at 64 (no pause: at batch 1 it still drafts).
    other = repeating_request("o")
    speculator.record(other, 4, 0)  # (an unknown request's record only counts)
    assert speculator.propose(other, 4, num_seqs=1) == [5, 6, 7, 8]
    speculator.record(other, 4, 1)
    speculator.record(other, 4, 0)
    assert speculator.propose(other, 4, num_seqs=64) == []
    assert speculator.propose(other, 4, num_seqs=1) == [5, 6, 7, 8]
    # Without a cost model every request drafts at every size.
    speculator.costs = None
    assert speculator.propose(other, 4, num_seqs=64) == [5, 6, 7, 8]


def test_a_priced_out_request_learns_from_the_drafts_it_would_have_had():
    """Priced out after its drafts were rejected, a request no longer drafts, so only its shadow
    lookups (checked against its tokens as they come, at no cost) can show that drafts would
    pay again: once the text copies itself, they do."""
    speculator = NgramSpeculator(SpeculativeConfig(num_speculative_tokens=4), costs=COSTS)
    request = Request("r", [1, 2, 3, 4, 5, 6, 7, 8, 9], SamplingParams(temperature=0.0))
    request.speculates = True
    for _ in range(4):  # its text did not go on as drafted: acceptance 1/18, below 0.5 at 64
        speculator.record(request, 4, 0)
    request.draft_resume_at = 0  # (whatever the pause: the cost model holds it back)
    request.append_output_token(1)
    assert speculator.propose(request, 4, num_seqs=64) == []
    for token in [2, 3, 4, 5, 6, 7, 8, 9] * 3:  # the text now repeats: each shadow is right
        request.append_output_token(token)
        speculator.observe(request)
    state = speculator._requests["r"]
    assert state.acceptance > COSTS.min_acceptance(64)
    request.append_output_token(1)
    assert speculator.propose(request, 4, num_seqs=64) == [2, 3, 4, 5]


def test_a_request_whose_lookups_find_nothing_does_not_make_the_batch_wait():
    """Under async scheduling a drafting request waits for its pending token; where its
    lookups rarely find drafts (random text), the drafts it may find do not pay for the wait
    at a batch size whose bar is above its hit rate times its acceptance."""
    speculator = NgramSpeculator(SpeculativeConfig(), async_scheduling=True, costs=COSTS)
    request = Request("r", [7, 1000], SamplingParams(temperature=0.0))
    request.speculates = True
    for token in range(2000, 2016):  # no token repeats: every shadow lookup finds nothing
        request.append_output_token(token)
        speculator.observe(request)
    request.append_output_token(7)  # 7 occurred before: the next token may end in a match
    request.num_pending_tokens = 1
    assert speculator.worth_waiting(request, num_seqs=1)  # at batch 1 a wait is cheap
    assert not speculator.worth_waiting(request, num_seqs=64)
    fresh = Request("f", [7, 1000, 7], SamplingParams(temperature=0.0))
    fresh.speculates, fresh.num_pending_tokens = True, 1
    assert speculator.worth_waiting(fresh, num_seqs=4)  # no lookups yet: the prior's 0.25
