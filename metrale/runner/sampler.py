"""Pick each request's next token from its logits, batched on the device.

One pass serves a whole batch of mixed requests. In vLLM's order: logprobs are read from the raw
logits; then banned tokens (min_tokens), logit bias and the repetition, frequency and presence
penalties reshape the logits, so they steer greedy rows too; then greedy rows take the argmax and
the others go through llama.cpp's top-nσ, typical and XTC where they ask for them
(`truncation.py`), then temperature, top-k, top-p and min-p, and draw by the inverse CDF
(`inverse_cdf.py`) with each row's uniform draw, made on the host before the step
(`random_draws.py`: a seeded request's from its seed and position alone, so its tokens do not
depend on what else shares the batch). Nothing here syncs with the host, and no random numbers
are made on the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from metrale.runner.inverse_cdf import inverse_cdf, tempered_inverse_cdf, weights_of
from metrale.runner.random_draws import DRAFT, TOKEN
from metrale.runner.repeat_penalties import RepeatPenalties, apply_repeat_penalties
from metrale.runner.truncation import Truncation, truncate


@dataclass(frozen=True)
class LogitBias:
    """The batch's logit_bias entries, flattened: entry i adds `values[i]` to one logit."""

    rows: torch.Tensor  # [num_entries] int64, rows of the batch
    token_ids: torch.Tensor  # [num_entries] int64
    values: torch.Tensor  # [num_entries] fp32


@dataclass(frozen=True)
class Drafts:
    """The rows that check a speculative draft, and the draft each checks: the token the row
    samples is the draft if accepted, else what replaces it."""

    rows: torch.Tensor  # [num_draft_rows] int64, rows of the batch
    token_ids: torch.Tensor  # [num_draft_rows] int64


@dataclass(frozen=True)
class RandomRows:
    """The per-row parameters of a batch in which some row draws at random."""

    temperature: torch.Tensor  # [num_rows] fp32; 0 marks a greedy row
    top_k: torch.Tensor  # [num_rows] fp32, a whole number; vocab size where disabled
    top_p: torch.Tensor  # [num_rows] fp32
    min_p: torch.Tensor  # [num_rows] fp32
    draws: torch.Tensor  # [num_rows, NUM_DRAWS] fp64 in [0, 1) (`random_draws.py`'s columns)
    any_greedy: bool
    any_top_k_or_p: bool
    any_min_p: bool


@dataclass(frozen=True)
class SamplingMetadata:
    random: RandomRows | None  # None: every row is greedy (nothing of the above is copied)
    banned: list[tuple[int, tuple[int, ...]]]  # (row, token ids) masked this step (min_tokens)
    max_num_logprobs: int | None  # largest top-N asked in the batch; None: no logprobs
    logit_bias: LogitBias | None = None  # None: no row has a logit bias
    forced: list[tuple[int, int]] = field(default_factory=list)  # (row, the only token allowed)
    grammar_bitmask: torch.Tensor | None = None  # [num_rows, vocab_size / 32] int32 (xgrammar)
    grammar_rows: list[int] = field(default_factory=list)  # the rows the bitmask applies to
    truncation: Truncation | None = None  # None: no sampled row uses top-nσ, typical or XTC
    drafts: Drafts | None = None  # None: no sampled row checks a draft
    penalties: RepeatPenalties | None = None  # None: no row has a penalty

    @property
    def all_greedy(self) -> bool:
        return self.random is None


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [num_rows] int64
    logprobs: torch.Tensor | None  # [num_rows] fp32, of the sampled token
    ranks: torch.Tensor | None  # [num_rows] int64, 1 = most likely
    top_ids: torch.Tensor | None  # [num_rows, max_num_logprobs]
    top_logprobs: torch.Tensor | None  # [num_rows, max_num_logprobs]


def sample(logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
    # logits: [num_rows, vocab_size] fp32
    raw_logprobs = None
    if meta.max_num_logprobs is not None:
        raw_logprobs = torch.log_softmax(logits, dim=-1)
    _adjust_logits(logits, meta)

    random = meta.random
    token_ids = logits.argmax(dim=-1) if random is None else _draw(logits, meta, random)

    if raw_logprobs is None:
        return SamplerOutput(token_ids, None, None, None, None)
    chosen = raw_logprobs.gather(1, token_ids.unsqueeze(1))  # [num_rows, 1]
    ranks = (raw_logprobs > chosen).sum(dim=-1) + 1
    top_logprobs, top_ids = raw_logprobs.topk(meta.max_num_logprobs, dim=-1)
    return SamplerOutput(token_ids, chosen.squeeze(1), ranks, top_ids, top_logprobs)


def _draw(logits: torch.Tensor, meta: SamplingMetadata, rows: RandomRows) -> torch.Tensor:
    """The batch's tokens: its greedy rows' argmax, the others drawn from their distribution."""
    greedy_ids = is_greedy = None
    temperature = rows.temperature
    if rows.any_greedy:  # drawn at temperature 1, then replaced by their argmax
        greedy_ids = logits.argmax(dim=-1)
        is_greedy = temperature == 0
        temperature = torch.where(is_greedy, 1.0, temperature)
    if meta.truncation is not None:  # at temperature 1, as llama.cpp's chain has them
        logits = truncate(logits, meta.truncation, rows.draws)
    if not rows.any_top_k_or_p and not rows.any_min_p and meta.drafts is None:
        sampled_ids = tempered_inverse_cdf(logits, temperature, rows.draws[:, TOKEN])
    else:
        logits = logits / temperature.unsqueeze(1)
        if rows.any_top_k_or_p:
            logits = _apply_top_k_top_p(logits, rows.top_k, rows.top_p)
        weights = weights_of(logits)
        if rows.any_min_p:
            weights = weights.masked_fill(weights < rows.min_p.unsqueeze(1), 0.0)
        sampled_ids = inverse_cdf(weights, rows.draws[:, TOKEN])
        if meta.drafts is not None:
            sampled_ids = _check_drafts(weights, sampled_ids, meta.drafts, rows.draws)
    if is_greedy is None:
        return sampled_ids
    return torch.where(is_greedy, greedy_ids, sampled_ids)


def _check_drafts(
    weights: torch.Tensor, sampled_ids: torch.Tensor, drafts: Drafts, draws: torch.Tensor
) -> torch.Tensor:
    """Rejection sampling of drafts that came with no distribution (prompt lookup: a point
    mass): a row keeps its draft with the probability its target distribution gives the draft,
    else it takes a sample of that distribution without the draft, which is the residual
    `max(0, p - q)` renormalized. Either way the row's token follows the target distribution,
    and the next row's draft counts only if this one was kept (the host stops at the first
    replaced row). Greedy rows keep their argmax, the same rule at temperature 0."""
    # weights: [num_rows, vocab_size], the unnormalized distributions
    rows, draft_ids = drafts.rows, drafts.token_ids
    p = weights.index_select(0, rows)  # [num_draft_rows, vocab_size]
    p_draft = p.gather(1, draft_ids.unsqueeze(1)).squeeze(1)
    row_draws = draws.index_select(0, rows)
    kept = row_draws[:, DRAFT] * p.sum(dim=-1) < p_draft
    # The row's own token draw over every token but the draft: a sample of the rest (the
    # row's sample from all of p, drawn with it, is replaced either way).
    without = p.scatter(1, draft_ids.unsqueeze(1), 0.0)
    replaced = inverse_cdf(without, row_draws[:, TOKEN])
    return sampled_ids.index_copy(0, rows, torch.where(kept, draft_ids, replaced))


def _adjust_logits(logits: torch.Tensor, meta: SamplingMetadata) -> None:
    """Ban, bias and penalise in place, in vLLM's order; rows asking for none stay bit-identical."""
    # logits: [num_rows, vocab_size] fp32
    for row, token_ids in meta.banned:
        logits[row, list(token_ids)] = float("-inf")
    if meta.logit_bias is not None:
        bias = meta.logit_bias
        logits.index_put_((bias.rows, bias.token_ids), bias.values, accumulate=True)
    if meta.penalties is not None:
        apply_repeat_penalties(logits, meta.penalties)
    if meta.grammar_bitmask is not None:
        from xgrammar import apply_token_bitmask_inplace

        apply_token_bitmask_inplace(logits, meta.grammar_bitmask, indices=meta.grammar_rows)
    for row, token_id in meta.forced:  # a spent thinking budget: only the block's end remains
        logits[row].fill_(float("-inf"))
        logits[row, token_id] = 0.0


def _apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Mask to -inf every token outside each row's top-k and top-p nucleus."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)
    outside = ranks.unsqueeze(0) >= top_k.unsqueeze(1)
    sorted_probs = sorted_logits.masked_fill(outside, float("-inf")).softmax(dim=-1)
    # A token is outside the nucleus once the mass before it already reaches top_p; the first
    # token is always kept. Rows with top_p = 1 are left whole: an fp32 cumulative sum reaches
    # 1.0 before the end of a large vocabulary and would cut its tail.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    outside |= (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    outside[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
