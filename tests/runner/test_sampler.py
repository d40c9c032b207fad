"""The batched sampler against plain references written here, one row at a time."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from metrale.runner.inverse_cdf import inverse_cdf_torch
from metrale.runner.random_draws import NUM_DRAWS, TOKEN, RandomDraws, Seeds, seeded_draws
from metrale.runner.sampler import RandomRows, SamplingMetadata, _apply_top_k_top_p, sample


def make_meta(
    temperature: list[float],
    vocab_size: int,
    *,
    top_k: list[int] | None = None,
    top_p: list[float] | None = None,
    min_p: list[float] | None = None,
    draws: torch.Tensor | None = None,
    banned: list[tuple[int, tuple[int, ...]]] | None = None,
    max_num_logprobs: int | None = None,
) -> SamplingMetadata:
    """Metadata as the model runner builds it: top_k 0 means disabled (the vocab size); the
    draws uniform from torch's generator unless given."""
    num_rows = len(temperature)
    top_k = top_k or [0] * num_rows
    top_p = top_p or [1.0] * num_rows
    min_p = min_p or [0.0] * num_rows
    random = None
    if any(t != 0 for t in temperature):
        random = RandomRows(
            temperature=torch.tensor(temperature, dtype=torch.float32),
            top_k=torch.tensor([k or vocab_size for k in top_k], dtype=torch.int64),
            top_p=torch.tensor(top_p, dtype=torch.float32),
            min_p=torch.tensor(min_p, dtype=torch.float32),
            draws=torch.rand(num_rows, NUM_DRAWS, dtype=torch.float64) if draws is None else draws,
            any_greedy=any(t == 0 for t in temperature),
            any_top_k_or_p=any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p),
            any_min_p=any(p > 0 for p in min_p),
        )
    return SamplingMetadata(random=random, banned=banned or [], max_num_logprobs=max_num_logprobs)


def redraw(meta: SamplingMetadata) -> SamplingMetadata:
    """The same metadata with fresh draws (the next step's, for the same rows)."""
    if meta.random is None:
        return meta
    draws = torch.rand_like(meta.random.draws)
    return dataclasses.replace(meta, random=dataclasses.replace(meta.random, draws=draws))


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def ref_top_k_kept(logits: torch.Tensor, k: int) -> set[int]:
    order = sorted(range(logits.numel()), key=lambda i: logits[i].item(), reverse=True)
    return set(order[:k])


def ref_top_p_kept(logits: torch.Tensor, p: float) -> set[int]:
    """The smallest prefix of tokens by falling probability whose mass reaches p."""
    probs = torch.softmax(logits.double(), dim=-1).tolist()
    order = sorted(range(len(probs)), key=lambda i: probs[i], reverse=True)
    kept, mass = set(), 0.0
    for i in order:
        kept.add(i)
        mass += probs[i]
        if mass >= p:
            break
    return kept


def kept_ids(masked_row: torch.Tensor) -> set[int]:
    return set(torch.nonzero(masked_row != float("-inf")).flatten().tolist())


def empirical(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    counts = torch.bincount(token_ids, minlength=vocab_size).double()
    return counts / counts.sum()


# --- greedy -------------------------------------------------------------------------------------


def test_greedy_rows_take_argmax_in_a_batch_mixed_with_random_rows():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    temperature = [0.0, 1.0, 0.0, 0.7, 0.0, 1.5]
    # Greedy rows carry sampling knobs too; they must not change the argmax.
    meta = make_meta(temperature, 50, top_k=[3, 5, 0, 0, 2, 0], top_p=[0.5, 1, 0.2, 0.9, 1, 1])
    argmax = logits.argmax(dim=-1)
    for trial in range(20):
        torch.manual_seed(trial)
        out = sample(logits.clone(), redraw(meta))
        for row in (0, 2, 4):
            assert out.token_ids[row] == argmax[row]
    assert out.logprobs is None and out.ranks is None and out.top_ids is None


def test_all_greedy_batch_takes_argmax():
    torch.manual_seed(1)
    logits = torch.randn(5, 300)
    out = sample(logits.clone(), make_meta([0.0] * 5, 300))
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))
    assert out.token_ids.dtype == torch.int64


def test_top_k_one_always_takes_argmax():
    torch.manual_seed(2)
    logits = torch.randn(8, 40) * 0.3  # flat: without top-k the argmax would often lose
    meta = make_meta([1.5] * 8, 40, top_k=[1] * 8)
    for trial in range(30):
        torch.manual_seed(100 + trial)
        assert torch.equal(sample(logits.clone(), redraw(meta)).token_ids, logits.argmax(dim=-1))


# --- top-k, top-p, min-p -----------------------------------------------------------------------


def test_top_k_keeps_exactly_the_k_largest():
    torch.manual_seed(3)
    vocab_size = 64
    logits = torch.randn(6, vocab_size) * 2
    ks = [1, 2, 5, 17, 63, vocab_size]
    masked = _apply_top_k_top_p(logits, torch.tensor(ks), torch.ones(6, dtype=torch.float32))
    for row, k in enumerate(ks):
        kept = kept_ids(masked[row])
        assert kept == ref_top_k_kept(logits[row], k)
        idx = sorted(kept)
        assert torch.equal(masked[row, idx], logits[row, idx]), "kept logits are unchanged"


@pytest.mark.parametrize("p", [1e-6, 0.1, 0.3, 0.5, 0.8, 0.95, 0.999, 1.0])
def test_top_p_keeps_the_smallest_prefix_reaching_p(p: float):
    torch.manual_seed(4)
    vocab_size = 64
    logits = torch.randn(16, vocab_size) * 2
    masked = _apply_top_k_top_p(
        logits, torch.full((16,), vocab_size), torch.full((16,), p, dtype=torch.float32)
    )
    for row in range(16):
        assert kept_ids(masked[row]) == ref_top_p_kept(logits[row], p), f"row {row}"
    if p == 1.0:
        assert torch.equal(masked, logits)
    if p == 1e-6:
        assert torch.equal((masked != float("-inf")).sum(dim=-1), torch.ones(16, dtype=torch.long))


def test_top_p_applies_to_the_top_k_renormalised_distribution():
    torch.manual_seed(5)
    vocab_size = 64
    logits = torch.randn(8, vocab_size) * 2
    k, p = 10, 0.6
    masked = _apply_top_k_top_p(
        logits, torch.full((8,), k), torch.full((8,), p, dtype=torch.float32)
    )
    for row in range(8):
        top = sorted(ref_top_k_kept(logits[row], k))
        nucleus = ref_top_p_kept(logits[row, top], p)
        assert kept_ids(masked[row]) == {top[i] for i in nucleus}


def test_top_p_one_keeps_a_large_vocabulary_whole():
    # A row with top_p=1.0 goes through the nucleus whenever another row of the batch uses
    # top-k or top-p, so p=1 must be a no-op there, whatever the vocabulary size.
    torch.manual_seed(6)
    vocab_size = 32_000
    logits = torch.randn(4, vocab_size) * 3
    masked = _apply_top_k_top_p(
        logits, torch.full((4,), vocab_size), torch.ones(4, dtype=torch.float32)
    )
    assert torch.equal(masked, logits)


def test_min_p_drops_tokens_below_min_p_times_the_max_prob():
    probs = torch.tensor([0.5, 0.3, 0.1, 0.06, 0.04])
    logits = probs.log()
    num_draws = 20_000
    # Threshold 0.15 * 0.5 = 0.075: tokens 3 and 4 go; the rest keep their relative odds.
    torch.manual_seed(7)
    meta = make_meta([1.0] * num_draws, 5, min_p=[0.15] * num_draws)
    out = sample(logits.expand(num_draws, 5).clone(), meta)
    freq = empirical(out.token_ids, 5)
    assert freq[3] == 0 and freq[4] == 0
    expected = torch.tensor([0.5, 0.3, 0.1, 0.0, 0.0], dtype=torch.float64) / 0.9
    assert (freq - expected).abs().max() < 0.02


def test_min_p_threshold_uses_the_tempered_distribution():
    # At T=2 the probs flatten to ~sqrt(p): [0.36, 0.28, 0.16, 0.12, 0.10] (normalised), so
    # with min_p=0.3 the threshold is ~0.107 and only token 4 drops; at T=1 tokens 3, 4 drop.
    probs = torch.tensor([0.5, 0.3, 0.1, 0.06, 0.04])
    logits = probs.log()
    tempered = torch.softmax(logits / 2, dim=-1)
    assert tempered[3] > 0.3 * tempered[0] > tempered[4]
    num_draws = 5_000
    torch.manual_seed(8)
    meta = make_meta([2.0] * num_draws, 5, min_p=[0.3] * num_draws)
    sampled = set(sample(logits.expand(num_draws, 5).clone(), meta).token_ids.tolist())
    assert sampled == {0, 1, 2, 3}


# --- banned tokens (min_tokens) ------------------------------------------------------------------


def test_banned_tokens_are_never_sampled_even_as_the_argmax():
    logits = torch.full((4, 6), -2.0)
    logits[:, 3] = 8.0  # ~0.99 of the mass on the token that gets banned
    logits[:, 1] = 1.0
    banned = [(0, (3,)), (1, (3,)), (2, (3, 1))]
    meta = make_meta([0.0, 1.0, 0.0, 1.0], 6, banned=banned)
    num_unbanned_top = 0
    for trial in range(50):
        torch.manual_seed(trial)
        out = sample(logits.clone(), redraw(meta))
        assert out.token_ids[0] == 1, "greedy row falls back to the next best token"
        assert out.token_ids[1] != 3
        assert out.token_ids[2] not in (1, 3)
        num_unbanned_top += int(out.token_ids[3] == 3)
    assert num_unbanned_top >= 45, "the ban is per row: row 3 still favours token 3"
    all_greedy = sample(logits.clone(), make_meta([0.0] * 4, 6, banned=banned))
    assert all_greedy.token_ids.tolist()[:2] == [1, 1]
    assert all_greedy.token_ids[3] == 3


# --- distribution ------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.6, 2.0])
def test_samples_follow_softmax_of_tempered_logits(temperature: float):
    logits = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0])
    num_draws = 20_000
    torch.manual_seed(9)
    meta = make_meta([temperature] * num_draws, 5)
    out = sample(logits.expand(num_draws, 5).clone(), meta)
    freq = empirical(out.token_ids, 5)
    expected = torch.softmax(logits.double() / temperature, dim=-1)
    # One standard deviation of a frequency here is at most 0.0036; allow ~4.
    assert (freq - expected).abs().max() < 0.015
    chi2 = (num_draws * (freq - expected) ** 2 / expected).sum()
    assert chi2 < 20.5  # p = 0.0004 at 4 degrees of freedom


def test_samples_after_top_k_follow_the_renormalised_kept_distribution():
    logits = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, 0.1])
    num_draws = 20_000
    torch.manual_seed(10)
    meta = make_meta([1.0] * num_draws, 6, top_k=[3] * num_draws)
    freq = empirical(sample(logits.expand(num_draws, 6).clone(), meta).token_ids, 6)
    kept = [3, 0, 1]
    expected = torch.zeros(6, dtype=torch.float64)
    expected[kept] = torch.softmax(logits[kept].double(), dim=-1)
    assert freq[[2, 4, 5]].sum() == 0
    assert (freq - expected).abs().max() < 0.015


# --- seeded rows -------------------------------------------------------------------------------


def seeded_steps(
    row_logits: torch.Tensor, seed: int, row: int, seeds: list[int | None], start: int = 40
) -> list[int]:
    """Ten steps of one seeded request placed at `row` of a batch of random other rows (seeded
    with `seeds`, None: unseeded), sampling positions `start`, `start + 1`, ..."""
    vocab_size = row_logits.numel()
    num_rows = len(seeds)
    batch_seeds = [*seeds[:row], seed, *seeds[row + 1 :]]
    draws = RandomDraws()
    tokens = []
    for step in range(10):
        logits = torch.randn(num_rows, vocab_size)
        logits[row] = row_logits
        out = np.zeros((num_rows, NUM_DRAWS))
        positions = [start + step if r == row else 3 * r + step for r in range(num_rows)]
        draws.fill(out, Seeds.of(batch_seeds), positions)
        meta = make_meta([1.0] * num_rows, vocab_size, draws=torch.from_numpy(out))
        tokens.append(sample(logits, meta).token_ids[row].item())
    return tokens


def test_seeded_row_depends_on_its_seed_and_position_alone():
    torch.manual_seed(11)
    row_logits = torch.randn(100) * 0.1  # near flat: ten draws make a distinctive sequence
    alone = seeded_steps(row_logits, seed=42, row=0, seeds=[None])
    assert seeded_steps(row_logits, seed=42, row=2, seeds=[None] * 5) == alone
    assert seeded_steps(row_logits, seed=42, row=1, seeds=[7, None, 8]) == alone
    assert seeded_steps(row_logits, seed=42, row=6, seeds=[42] * 7) == alone
    assert seeded_steps(row_logits, seed=43, row=0, seeds=[None]) != alone
    assert seeded_steps(row_logits, seed=42, row=0, seeds=[None], start=41) != alone
    assert len(set(alone)) > 1, "the draws change from position to position"


def test_same_seed_in_two_rows_of_one_batch_draws_the_same_tokens():
    torch.manual_seed(12)
    row_logits = torch.randn(100) * 0.1
    logits = row_logits.expand(3, 100).clone()
    firsts, thirds = [], []
    for position in range(10):
        draws = np.zeros((3, NUM_DRAWS))
        RandomDraws().fill(draws, Seeds.of([5, 5, 6]), [position] * 3)
        out = sample(logits.clone(), make_meta([1.0] * 3, 100, draws=torch.from_numpy(draws)))
        assert out.token_ids[0] == out.token_ids[1]
        firsts.append(out.token_ids[0].item())
        thirds.append(out.token_ids[2].item())
    assert firsts != thirds


def test_seeded_draws_are_uniform_and_independent():
    """Over 1M (seed, position) pairs, small seeds of both signs (what users pass) at
    consecutive positions: each column's deciles hold a tenth each, and neither the columns nor
    neighbouring positions nor neighbouring seeds correlate."""
    seeds = np.repeat(np.arange(-100, 100), 5000).tolist()
    positions = np.tile(np.arange(5000), 200).tolist()
    draws = seeded_draws(seeds, positions)
    assert draws.shape == (1_000_000, NUM_DRAWS)
    assert ((draws >= 0) & (draws < 1)).all()
    for column in draws.T:
        counts = np.histogram(column, bins=10, range=(0, 1))[0]
        chi2 = (((counts - 100_000) ** 2) / 100_000).sum()
        assert chi2 < 33.7  # p = 0.0001 at 9 degrees of freedom
    corr = np.corrcoef(draws.T)
    assert np.abs(corr - np.eye(NUM_DRAWS)).max() < 0.005
    grid = draws[:, TOKEN].reshape(200, 5000)  # [seed, position]
    assert abs(np.corrcoef(grid[:, :-1].ravel(), grid[:, 1:].ravel())[0, 1]) < 0.005
    assert abs(np.corrcoef(grid[:-1].ravel(), grid[1:].ravel())[0, 1]) < 0.005


def test_unseeded_rows_draw_afresh_each_fill():
    draws, a, b = RandomDraws(), np.zeros((4, NUM_DRAWS)), np.zeros((4, NUM_DRAWS))
    draws.fill(a, Seeds.of([None, 3, None, None]), [10] * 4)
    draws.fill(b, Seeds.of([None, 3, None, None]), [10] * 4)
    assert (a[[0, 2, 3]] != b[[0, 2, 3]]).all()
    assert (a[1] == b[1]).all() and (a[1] == seeded_draws([3], [10])[0]).all()


def test_inverse_cdf_never_draws_a_zero_probability_token():
    """At the ends of [0, 1) and everywhere between, over rows whose mass sits at either end
    of the vocabulary or between runs of zeros."""
    probs = torch.zeros(5, 50)
    probs[0, 0] = 1.0
    probs[1, -1] = 1.0
    probs[2, 10:40:3] = 0.1
    probs[3, [5, 6]] = torch.tensor([1e-3, 0.5])
    probs[4, 7] = 2.0**-45  # below the fixed point's unit: as good as zero, but not every token
    probs[4, 9] = 0.25
    for u in [0.0, 1e-9, 0.3, 0.5, 0.999, 1.0 - 2.0**-53]:
        ids = inverse_cdf_torch(probs, torch.full((5,), u, dtype=torch.float64))
        assert ids[0] == 0 and ids[1] == 49 and ids[4] == 9
        assert probs[2, ids[2]] > 0 and probs[3, ids[3]] > 0


# --- logprobs ----------------------------------------------------------------------------------


def test_logprobs_ranks_and_top_logprobs_use_the_raw_logits():
    torch.manual_seed(13)
    vocab_size = 30
    logits = torch.randn(6, vocab_size) * 2
    top1 = logits.argmax(dim=-1)
    # Row 1: greedy with its argmax banned, so it takes rank 2. Others are tempered and
    # top-k'd: the reported logprobs must still be those of the raw logits.
    banned = [(1, (top1[1].item(),))]
    meta = make_meta(
        [0.0, 0.0, 0.5, 1.0, 2.0, 1.0],
        vocab_size,
        top_k=[0, 0, 5, 0, 0, 3],
        banned=banned,
        max_num_logprobs=4,
    )
    raw = torch.log_softmax(logits, dim=-1)
    seen_ranks = set()
    for trial in range(20):
        torch.manual_seed(trial)
        out = sample(logits.clone(), redraw(meta))
        assert out.logprobs is not None and out.ranks is not None
        assert out.top_ids is not None and out.top_logprobs is not None
        for row in range(6):
            token = out.token_ids[row].item()
            assert out.logprobs[row].item() == pytest.approx(raw[row, token].item(), abs=1e-5)
            expected_rank = 1 + sorted(raw[row].tolist(), reverse=True).index(
                raw[row, token].item()
            )
            assert out.ranks[row].item() == expected_rank
            seen_ranks.add(expected_rank)
        assert out.ranks[0] == 1
        assert out.ranks[1] == 2
        expected_top, expected_ids = torch.topk(raw, 4, dim=-1)
        assert torch.equal(out.top_ids, expected_ids)
        torch.testing.assert_close(out.top_logprobs, expected_top)
    assert seen_ranks > {1, 2}, "random rows also land on lower-ranked tokens"
