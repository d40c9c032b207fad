"""Rejection sampling of speculative drafts: whatever the draft, a row's token follows its target
distribution (temperature, top-k, min-p applied), the draft is kept as often as that
distribution gives it, and greedy rows keep their argmax. Counted over many rows of one batch."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from metrale.runner.random_draws import seeded_draws
from metrale.runner.sampler import Drafts, sample
from tests.runner.test_sampler import make_meta

VOCAB = 8
NUM_ROWS = 40_000
LOGITS = torch.tensor([2.0, 1.2, 0.4, 0.0, -0.5, -1.0, 1.6, -3.0])


def target(temperature: float, top_k: int = 0, min_p: float = 0.0) -> torch.Tensor:
    """The distribution the sampler draws from, computed here in float64."""
    probs = torch.softmax(LOGITS.double() / temperature, dim=-1)
    if top_k:
        probs[probs.argsort(descending=True)[top_k:]] = 0.0
    if min_p:
        probs[probs < min_p * probs.max()] = 0.0
    return probs / probs.sum()


def draft_rows(draft: int, temperature: float, **filters) -> torch.Tensor:
    """NUM_ROWS copies of the row, each checking `draft`; their tokens."""
    meta = make_meta(
        [temperature] * NUM_ROWS,
        VOCAB,
        top_k=[filters.get("top_k", 0)] * NUM_ROWS,
        min_p=[filters.get("min_p", 0.0)] * NUM_ROWS,
    )
    rows = torch.arange(NUM_ROWS)
    drafts = Drafts(rows, torch.full((NUM_ROWS,), draft))
    meta = dataclasses.replace(meta, drafts=drafts)
    return sample(LOGITS.repeat(NUM_ROWS, 1), meta).token_ids


@pytest.mark.parametrize(
    ("draft", "temperature", "filters"),
    [
        (0, 1.0, {}),  # the likeliest token
        (5, 1.0, {}),  # an unlikely one
        (3, 0.7, {"top_k": 4}),
        (7, 1.0, {"top_k": 3}),  # a draft the filters exclude: never kept
        (2, 1.3, {"min_p": 0.2}),
    ],
)
def test_tokens_follow_the_target_whatever_the_draft(draft, temperature, filters):
    torch.manual_seed(draft)
    tokens = draft_rows(draft, temperature, **filters)
    p = target(temperature, **filters)
    counts = torch.bincount(tokens, minlength=VOCAB).double()
    expected = p * NUM_ROWS
    for token in range(VOCAB):
        # within five standard deviations of a binomial count; zero where the target is zero
        sigma = math.sqrt(max(expected[token].item() * (1 - p[token].item()), 1e-9))
        assert abs(counts[token] - expected[token]) <= 5 * sigma + 1e-6, (token, counts, expected)


def test_greedy_rows_keep_their_argmax():
    meta = make_meta([0.0, 0.0, 1.0], VOCAB)
    drafts = Drafts(torch.tensor([0, 1]), torch.tensor([0, 3]))
    meta = dataclasses.replace(meta, drafts=drafts)
    tokens = sample(LOGITS.repeat(3, 1), meta).token_ids
    assert tokens[:2].tolist() == [0, 0]  # the argmax: the draft 0 kept, the draft 3 replaced


def test_seeded_rows_check_drafts_with_their_own_draws():
    """A seeded row's draft check uses its own draws (acceptance and replacement): the same
    seeds and positions give the same tokens, whatever the global generator's state, and other
    positions other tokens."""

    def once(global_seed: int, position: int) -> list[int]:
        torch.manual_seed(global_seed)
        draws = torch.from_numpy(
            seeded_draws([11, 12, 13, 14] * 8, [position + i for i in range(32)])
        )
        meta = make_meta([1.0] * 32, VOCAB, draws=draws)
        drafts = Drafts(torch.arange(32), torch.full((32,), 5))
        meta = dataclasses.replace(meta, drafts=drafts)
        return sample(LOGITS.repeat(32, 1), meta).token_ids.tolist()

    assert once(1, 100) == once(2, 100)
    assert once(1, 100) != once(1, 200)
