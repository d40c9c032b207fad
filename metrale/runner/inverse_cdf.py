"""Draw one token per row from its weights by the inverse CDF: the token where the row's running
sum of weights first passes its uniform draw times the row's total.

The weights are counted in fixed point first, each `floor(w * 2**40)` as an int64, so the
running sums are exact, rise with every token and agree on every device: a token of weight zero
is never drawn, and the same weights and draw give the same token on the CPU, in the Triton
kernels (`kernels/inverse_cdf.py`, on the GPU) and in the torch formula here (the CPU's path and
the kernels' reference). The weights need not be normalized: the sampler's are `exp(l - max l)`
of the tempered logits `l` (its most likely token weighs 1), which min-p and top-k/p zero where
they cut. A token under 2**-40 (1e-12) of the most likely one's weight is never drawn.

The common case (temperature alone) runs `tempered_inverse_cdf`: on the GPU the weights are
computed inside the kernels from the logits, which are read three times and never written; on
a CPU one C++ op (`kernels/cpu/inverse_cdf.cpp`) does the same, row by row, and returns this
formula's tokens.

One uniform draw per row replaces the exponential race's one per token: the draws come from the
host (`random_draws.py`), seeded rows included, so no random-number kernel runs at all.
"""

from __future__ import annotations

import torch

from metrale.kernels import cpu_extension

PROB_SCALE = float(2**40)


def inverse_cdf(weights: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """[num_rows] int64 token ids: row r's token for the uniform `draws[r]` in [0, 1).

    weights: [num_rows, vocab_size] fp32, non-negative; draws: [num_rows] fp64."""
    if weights.is_cuda:
        from metrale.kernels.inverse_cdf import inverse_cdf as kernel

        return kernel(weights, draws)
    return inverse_cdf_torch(weights, draws)


def tempered_inverse_cdf(
    logits: torch.Tensor, temperature: torch.Tensor, draws: torch.Tensor
) -> torch.Tensor:
    """`inverse_cdf` of `tempered_weights(logits, temperature)` (temperature > 0 per row)."""
    if logits.is_cuda:
        from metrale.kernels.inverse_cdf import tempered_inverse_cdf as kernel

        return kernel(logits, temperature, draws)
    if logits.dtype == torch.float32 and logits.stride(1) == 1 and cpu_extension.enabled():
        return torch.ops.metrale_cpu.tempered_inverse_cdf(logits, temperature.contiguous(), draws)
    return inverse_cdf_torch(tempered_weights(logits, temperature), draws)


def tempered_weights(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """`exp(l - max l)` of each row's logits over its temperature: the softmax times the most
    likely token's inverse probability, so it weighs 1."""
    return weights_of(logits / temperature.unsqueeze(1))


def weights_of(logits: torch.Tensor) -> torch.Tensor:
    """`exp(l - max l)` of each row: the softmax times the inverse of its largest probability,
    so the most likely token weighs 1."""
    return torch.exp(logits - logits.amax(dim=-1, keepdim=True))


def inverse_cdf_torch(weights: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    counts = (weights * PROB_SCALE).to(torch.int64).cumsum(dim=-1)
    total = counts[:, -1]
    target = torch.minimum((draws * total.double()).to(torch.int64), total - 1)
    # The number of tokens whose running sum is at most the target: the first token past it.
    ids = torch.searchsorted(counts, target.unsqueeze(1), right=True).squeeze(1)
    return ids.clamp_(max=weights.shape[-1] - 1)
