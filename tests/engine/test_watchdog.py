"""The content-loop watchdog: the detector against the definition written out by brute force,
then in the scheduler (a looping script ends with stop and its reason; min_tokens holds it)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metrale.engine.messages import FinishReason
from metrale.engine.watchdog import MAX_PERIOD, MIN_SPAN, STOP_REASON, LoopDetector
from metrale.sampling_params import SamplingParams, ThinkingBudget
from tests.engine.fake_runner import FakeRunner
from tests.engine.test_scheduler import make_scheduler, request


def loops_at(tokens: list[int], min_repeats: int) -> int | None:
    """The first position after which the output ends in one block repeated enough: r copies
    of p tokens, r >= max(min_repeats, ceil(MIN_SPAN / p)), p <= MAX_PERIOD."""
    for end in range(1, len(tokens) + 1):
        for p in range(1, MAX_PERIOD + 1):
            r = max(min_repeats, -(-MIN_SPAN // p))
            if p * r <= end:
                tail = tokens[end - p * r : end]
                if all(tail[i] == tail[i % p] for i in range(len(tail))):
                    return end
    return None


def first_fire(tokens: list[int], min_repeats: int) -> int | None:
    detector = LoopDetector(min_repeats)
    for i, token in enumerate(tokens):
        if detector.push(token) is not None:
            return i + 1
    return None


@settings(max_examples=150, deadline=None)
@given(
    prefix=st.lists(st.integers(0, 5), max_size=40),
    block=st.lists(st.integers(0, 5), min_size=1, max_size=20),
    copies=st.integers(1, 12),
    min_repeats=st.integers(2, 6),
)
def test_the_detector_fires_where_the_definition_says(prefix, block, copies, min_repeats):
    tokens = prefix + block * copies + prefix[:3]
    assert first_fire(tokens, min_repeats) == loops_at(tokens, min_repeats)


def test_a_short_rule_is_not_a_loop_but_a_long_one_is():
    dashes = [7] * (MIN_SPAN - 1)
    assert first_fire(dashes, 4) is None  # 31 of one token: under the span
    assert first_fire([*dashes, 7], 4) == MIN_SPAN
    sentence = list(range(100, 110))  # ten tokens: four copies cover the span
    assert first_fire(sentence * 3, 4) is None
    assert first_fire(sentence * 4, 4) == 40
    assert first_fire(list(range(200, 300)), 2) is None  # no repeat at all


def test_a_bad_repeat_count_is_refused():
    with pytest.raises(ValueError, match="content_loop_min_repeats"):
        SamplingParams(content_loop_min_repeats=1)
    with pytest.raises(ValueError, match="content_loop_min_repeats"):
        LoopDetector(1)


class LoopingRunner(FakeRunner):
    """Every request writes 5, 6, 7, 8 over and over."""

    def collect(self, scheduled):
        out = super().collect(scheduled)
        positions = [c.start_pos + c.num_tokens for c in scheduled.chunks if c.samples]
        prompt_lens = {r.request_id: r.num_prompt_tokens for r in scheduled.requests}
        ids = [c.request_id for c in scheduled.chunks if c.samples]
        out.sampled_token_ids[:] = [
            5 + (pos - prompt_lens[rid]) % 4 for rid, pos in zip(ids, positions, strict=True)
        ]
        return out


@pytest.mark.parametrize(
    ("repeats", "min_tokens", "ends_at"), [(4, 0, 32), (9, 0, 36), (4, 50, 51)]
)
def test_a_looping_request_stops_with_the_watchdogs_reason(repeats, min_tokens, ends_at):
    """Blocks of 4 tokens: 8 copies make the 32-token span, 9 asked for take 36; a stop does
    not come before min_tokens, so that request ends on the first token past them."""
    s = make_scheduler()
    params = {"content_loop_min_repeats": repeats, "min_tokens": min_tokens}
    s.add_request(request("loop", prompt_len=6, max_tokens=200, **params))
    s.add_request(request("calm", prompt_len=6, max_tokens=200))
    runner = LoopingRunner()
    outputs, reasons, stop_reasons = {}, {}, {}
    while s.num_unfinished_requests:
        scheduled = s.schedule()
        for out in s.update(scheduled, runner.execute(scheduled)):
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
                stop_reasons[out.request_id] = out.stop_reason
    assert len(outputs["loop"]) == ends_at
    assert reasons["loop"] is FinishReason.STOP and stop_reasons["loop"] == STOP_REASON
    assert len(outputs["calm"]) == 200 and reasons["calm"] is FinishReason.LENGTH
    assert stop_reasons["calm"] is None


class ThinkingLoopRunner(FakeRunner):
    """Opens a thinking block (50), then writes 5, 6, 7, 8 over and over; a forced token is
    what it samples, as the real sampler does."""

    def collect(self, scheduled):
        out = super().collect(scheduled)
        chunks = [c for c in scheduled.chunks if c.samples]
        starts = {r.request_id: r.num_prompt_tokens for r in scheduled.requests}
        out.sampled_token_ids[:] = [
            c.forced_token_id
            if c.forced_token_id is not None
            else (
                50 if (n := c.start_pos + c.num_tokens - starts[c.request_id]) == 0 else 5 + n % 4
            )
            for c in chunks
        ]
        return out


def test_a_looping_thinking_block_is_closed_and_the_answer_watched_afresh():
    """Inside a thinking block the watchdog forces its end instead of ending the generation;
    the answer that follows gets a fresh detector, so it takes a whole span more to stop."""
    s = make_scheduler()
    thinking = ThinkingBudget(max_tokens=1000, start_token_id=50, end_token_id=51)
    s.add_request(
        request("t", prompt_len=6, max_tokens=300, content_loop_min_repeats=4, thinking=thinking)
    )
    runner = ThinkingLoopRunner()
    tokens, reasons = [], []
    while s.num_unfinished_requests:
        scheduled = s.schedule()
        for out in s.update(scheduled, runner.execute(scheduled)):
            tokens += out.new_token_ids
            reasons.append(out.stop_reason)
    # 50, then 32 tokens of the loop (8 blocks of 4): the 33rd output is the forced </think>
    assert tokens[0] == 50 and 51 not in tokens[:33] and tokens[33] == 51
    assert s.num_thinking_loops_closed == 1
    # after it the loop resumes and the content watchdog ends it 32 tokens on
    assert len(tokens) == 34 + 32 and reasons[-1] == STOP_REASON
