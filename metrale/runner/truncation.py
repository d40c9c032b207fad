"""llama.cpp's truncation samplers, batched on the device: top-nσ, locally typical sampling and
XTC (exclude top choices).

Each follows llama.cpp's definition (`src/llama-sampling.cpp`, `llama_sampler_top_n_sigma_apply`,
`llama_sampler_typical_apply`, `llama_sample_xtc_apply`, with `min_keep` 1 as its server uses)
and runs in llama.cpp's order among themselves (top-nσ, then typical, then XTC: `common.h`'s
default sampler chain), each on the candidates the one before left. They work on the
penalised logits at temperature 1, as llama.cpp's chain does (its temperature comes last),
before this sampler's temperature and the vLLM-style top-k, top-p and min-p (`sampler.py`), so
a request that combines them with those gets vLLM's meaning for the old knobs. Only the rows
that use one of them are gathered and written back; the others are never touched.

- top-nσ (n > 0): over the finite logits, tokens below `max - n * std` (the population
  standard deviation) are masked. Scaling by a temperature scales both sides alike, so the
  set does not depend on the temperature.
- typical (p < 1): with the softmax `q` and its entropy `H`, tokens are ranked by
  `|-log q - H|`, and the smallest prefix of that ranking whose mass exceeds p is kept (the
  token that crosses p included).
- XTC (probability > 0, threshold <= 0.5): with chance `probability` a step (one uniform draw
  per row, the row's XTC draw from `random_draws.py`), of the tokens whose softmax
  probability is at least `threshold`, all but the least probable are masked, if there are two
  or more.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from metrale.runner.random_draws import XTC

XTC_MAX_THRESHOLD = 0.5  # above it llama.cpp's XTC does nothing (no two tokens can exceed it)


@dataclass(frozen=True)
class Truncation:
    """The sampled rows of a batch that use any of the three; each value off where unused."""

    rows: torch.Tensor  # [k] int64, rows of the batch
    top_n_sigma: torch.Tensor  # [k] fp32; <= 0: off
    typical_p: torch.Tensor  # [k] fp32; 1: off
    xtc_threshold: torch.Tensor  # [k] fp32
    xtc_probability: torch.Tensor  # [k] fp32; 0: off
    any_top_n_sigma: bool
    any_typical: bool
    any_xtc: bool


def truncate(logits: torch.Tensor, t: Truncation, draws: torch.Tensor) -> torch.Tensor:
    """`logits` with the truncated tokens of `t`'s rows at -inf (the others as they were);
    `draws` the batch's (`RandomRows.draws`)."""
    # logits: [num_rows, vocab_size] fp32
    sub = logits.index_select(0, t.rows)
    if t.any_top_n_sigma:
        sub = _top_n_sigma(sub, t.top_n_sigma)
    if t.any_typical:
        sub = _typical(sub, t.typical_p)
    if t.any_xtc:
        sub = _xtc(sub, t, draws.index_select(0, t.rows)[:, XTC])
    return logits.index_copy(0, t.rows, sub)


def _top_n_sigma(logits: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    finite = torch.isfinite(logits)
    count = finite.sum(dim=-1, keepdim=True).clamp(min=1)
    values = torch.where(finite, logits, 0.0)
    mean = values.sum(dim=-1, keepdim=True) / count
    spread = torch.where(finite, (logits - mean) ** 2, 0.0).sum(dim=-1, keepdim=True)
    std = (spread / count).sqrt()
    cut = logits.amax(dim=-1, keepdim=True) - n.unsqueeze(1) * std
    on = (n > 0).unsqueeze(1)
    return logits.masked_fill(on & (logits < cut), float("-inf"))


def _typical(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    log_q = torch.log_softmax(logits, dim=-1)
    q = log_q.exp()
    entropy = -torch.where(q > 0, q * log_q, 0.0).sum(dim=-1, keepdim=True)
    score = torch.where(q > 0, (-log_q - entropy).abs(), float("inf"))
    order = score.argsort(dim=-1, stable=True)
    sorted_q = q.gather(1, order)
    mass_before = sorted_q.cumsum(dim=-1) - sorted_q
    dropped_sorted = mass_before > p.unsqueeze(1)
    dropped = torch.empty_like(dropped_sorted).scatter_(1, order, dropped_sorted)
    on = (p < 1.0).unsqueeze(1)
    return logits.masked_fill(on & dropped, float("-inf"))


def _xtc(logits: torch.Tensor, t: Truncation, draws: torch.Tensor) -> torch.Tensor:
    q = torch.softmax(logits, dim=-1)
    above = q >= t.xtc_threshold.unsqueeze(1)
    keep = torch.where(above, q, float("inf")).argmin(dim=-1, keepdim=True)  # least probable
    removed = above.scatter(1, keep, False)
    candidates = torch.isfinite(logits).sum(dim=-1)
    on = (
        (t.xtc_probability > 0)
        & (t.xtc_threshold <= XTC_MAX_THRESHOLD)
        & (draws <= t.xtc_probability)
        & (above.sum(dim=-1) >= 2)
        & (candidates >= 2)
    )
    return logits.masked_fill(on.unsqueeze(1) & removed, float("-inf"))
