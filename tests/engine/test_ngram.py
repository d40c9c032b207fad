"""The n-gram index against a brute-force search of the whole history, as tokens arrive."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metrale.engine.speculation.ngram import NgramIndex


def brute_force(tokens: list[int], ngram_min: int, ngram_max: int, k: int) -> list[int]:
    """The longest n whose end-of-sequence n-gram occurs ending earlier, at its latest such
    occurrence: the k tokens after it."""
    size = len(tokens)
    for n in range(min(ngram_max, size), ngram_min - 1, -1):
        suffix = tokens[size - n :]
        for end in range(size - 2, n - 2, -1):
            if tokens[end - n + 1 : end + 1] == suffix:
                return tokens[end + 1 : end + 1 + k]
    return []


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 4), min_size=1, max_size=60),
    ngram_min=st.integers(1, 3),
    extra=st.integers(0, 3),
    k=st.integers(1, 6),
    chunk=st.integers(1, 7),
)
def test_proposals_match_a_search_of_the_whole_history(tokens, ngram_min, extra, k, chunk):
    index = NgramIndex(ngram_min, ngram_min + extra)
    for start in range(0, len(tokens), chunk):  # a prompt, then tokens in bursts
        index.extend(tokens[start : start + chunk])
        seen = tokens[: start + chunk]
        assert index.propose(k) == brute_force(seen, ngram_min, ngram_min + extra, k)


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 4), min_size=0, max_size=40),
    ngram_min=st.integers(1, 3),
    extra=st.integers(0, 2),
)
def test_a_match_after_one_more_token_is_foreseen_exactly(tokens, ngram_min, extra):
    """`may_match_after_one_more` is true exactly when some next token (one seen, or a new
    one) would give a proposal."""
    index = NgramIndex(ngram_min, ngram_min + extra)
    index.extend(tokens)
    some_next_matches = any(
        brute_force([*tokens, nxt], ngram_min, ngram_min + extra, 1) for nxt in range(6)
    )
    assert index.may_match_after_one_more() == some_next_matches


def test_a_copy_is_proposed_from_its_source():
    source = list(range(100, 140))
    index = NgramIndex(2, 4)
    index.extend([*source, 7, 8, *source[:5]])
    assert index.propose(4) == source[5:9]
    assert index.match() == (4, 4)  # 4-gram 101..104 ended at position 4


def test_no_match_no_draft():
    index = NgramIndex(2, 3)
    index.extend([1, 2, 3, 4])
    assert index.propose(4) == []
    index.extend([2])  # a 1-gram repeat is below ngram_min
    assert index.propose(4) == []


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError, match="ngram_min"):
        NgramIndex(3, 2)


def test_a_request_whose_drafts_fail_pauses_longer_each_time():
    """Under async scheduling, lookups that find nothing (each waited for the step before), or
    drafts rejected, pause drafting for 8 tokens, then 16; an attempt that pays resets it."""
    from metrale.engine.request import Request
    from metrale.engine.speculation.config import SpeculativeConfig
    from metrale.engine.speculation.speculator import ATTEMPTS, FIRST_PAUSE, NgramSpeculator
    from metrale.sampling_params import SamplingParams

    speculator = NgramSpeculator(SpeculativeConfig(ngram_min=2, ngram_max=2), async_scheduling=True)
    request = Request("r", [1, 2, 3, 4, 5, 6], SamplingParams())
    for _ in range(ATTEMPTS):  # no 2-gram repeats yet: each lookup is a miss
        assert speculator.propose(request, 4) == []
        request.append_output_token(100 + request.num_tokens)
    assert request.draft_resume_at == request.num_tokens - 1 + FIRST_PAUSE
    for token in [1, 2]:  # "1 2" repeats: a match, but paused
        request.append_output_token(token)
    assert request.num_tokens < request.draft_resume_at
    assert speculator.propose(request, 4) == []
    while request.num_tokens < request.draft_resume_at:
        request.append_output_token(1)
        request.append_output_token(2)
    assert speculator.propose(request, 4) != []  # drafts again after the pause
    for _ in range(ATTEMPTS):
        speculator.record(request, 4, 0)  # all rejected: the next pause is twice as long
    assert request.draft_resume_at == request.num_tokens + 2 * FIRST_PAUSE
    request.draft_resume_at = 0
    for _ in range(ATTEMPTS):
        speculator.record(request, 4, 3)
    assert speculator._requests["r"].pause == FIRST_PAUSE
