"""Draw one token per row from its distribution by the inverse CDF: the token where the row's
cumulative probability first passes its uniform draw times the row's total.

The probabilities are counted in fixed point first, each `floor(p * 2**40)` as an int64, so the
running sums are exact, rise with every token and agree on every device: a token of probability
zero is never drawn, and the same probabilities and draw give the same token on the CPU, in the
Triton kernel (`kernels/inverse_cdf.py`, one launch on the GPU) and in this torch formula (the
CPU's path and the kernel's reference). A token below 2**-40 (1e-12) is never drawn; all of them
together weigh at most the vocabulary's size times that. The rows need not be normalized (min-p
zeroes without renormalizing).

One uniform draw per row replaces the exponential race's one per token: the draws come from the
host (`random_draws.py`), seeded rows included, so no random-number kernel runs at all.
"""

from __future__ import annotations

import torch

PROB_SCALE = float(2**40)


def inverse_cdf(probs: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """[num_rows] int64 token ids: row r's token for the uniform `draws[r]` in [0, 1).

    probs: [num_rows, vocab_size] fp32, non-negative; draws: [num_rows] fp64."""
    if probs.is_cuda:
        from metrale.kernels.inverse_cdf import inverse_cdf as kernel

        return kernel(probs, draws)
    return inverse_cdf_torch(probs, draws)


def inverse_cdf_torch(probs: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    counts = (probs * PROB_SCALE).to(torch.int64).cumsum(dim=-1)
    total = counts[:, -1]
    target = torch.minimum((draws * total.double()).to(torch.int64), total - 1)
    # The number of tokens whose running sum is at most the target: the first token past it.
    ids = torch.searchsorted(counts, target.unsqueeze(1), right=True).squeeze(1)
    return ids.clamp_(max=probs.shape[-1] - 1)
