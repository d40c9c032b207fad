"""Penalties on repeating earlier text, batched on the device: the counted penalties, llama.cpp's
DRY and the LZ penalty, in that order (llama.cpp's chain: penalties, then DRY).

All read a request's token history on the device (`repeat_history.py`); DRY and the LZ penalty
also its suffix matches: `matches[p]` is how many tokens the sequence up to position `p` shares
at its end with the whole sequence. They reshape the logits before any sampling choice, so they
steer greedy rows too.

**The counted penalties**, over the last `repetition_penalty_window` tokens of prompt and
output (0: all), as vLLM defines them: repetition (Hugging Face's) divides a seen token's
positive logit by the penalty and multiplies a negative one, over prompt and output; frequency
(OpenAI's) subtracts per occurrence in the output, presence once per token in the output.

**DRY** ("don't repeat yourself"), as llama.cpp defines it (`src/llama-sampling.cpp`,
`llama_sampler_dry_apply`, after koboldcpp): over the last `dry_penalty_last_n` tokens (-1: all),
a repeat may not reach past the latest sequence breaker (its `rep_limit`); a token `t` that would
extend a repeat of length `L >= dry_allowed_length` (the tokens before `t`'s earlier occurrence
match the end of the sequence for `L` tokens) loses
`dry_multiplier * dry_base ** (L - dry_allowed_length)`, with the longest such `L` over its
occurrences, the exponent clamped so the power stays finite, and single-token breakers never
penalised.

**The LZ penalty** is after Ginart et al., "LZ Penalty: an information-theoretic repetition
penalty for autoregressive language models" (arXiv:2504.20131, 2025): a token is penalised by how
much cheaper an LZ77 coder would code it than a literal. The paper leaves the codelengths to its
implementation; ours, defined here: an LZ77 coder over token ids with a sliding window of the
last 512 tokens and matches of at most 32 tokens codes a match of length `l` at distance `d` in
`ln d + ln l` nats, so per token `(ln d + ln l) / l`, and a literal in `ln V` nats (V: the
logits' width). For a candidate `t`, `c(t)` is the least per-token cost over the matches that end
with `t` at the next position (any occurrence of `t` in the window, with any length up to the
longest the context allows there); `t`'s logit loses `lz_penalty * max(0, ln V - c(t))`. A token
that repeats the previous one (`d = 1`) costs nothing and loses the most; a token last seen far
back loses little, unless it continues a long match. Tokens absent from the window are untouched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

LZ_WINDOW_LEN = 512  # the coder's sliding window, in tokens
LZ_BUFFER_LEN = 32  # its longest match
FLOAT_MAX_LOG = 88.7228391  # ln of the largest float32: llama.cpp's bound on DRY's exponent
NO_TAIL = 1 << 40


def dry_max_exponent(base: float) -> int:
    """llama.cpp's clamp of DRY's exponent, so that `base ** exponent` stays finite; 0: none."""
    return int(FLOAT_MAX_LOG / math.log(base)) if base > 1.000001 else 0


@dataclass(frozen=True)
class RepeatPenalties:
    """The sampled rows of a step that use DRY or the LZ penalty, and the history they read."""

    tokens: torch.Tensor  # [num_slots, width] int64: each slot's tokens
    matches: torch.Tensor  # [num_slots, width] int32: their suffix matches
    single_breakers: torch.Tensor  # [num_breaker_sets, vocab_size] bool
    rows: torch.Tensor  # [k] int64, rows of the batch
    slots: torch.Tensor  # [k] int64
    lengths: torch.Tensor  # [k] int64: tokens in the slot (the sequence so far)
    max_len: int
    pending: torch.Tensor  # [k] bool: the host has not seen the slot's last token
    breaker_set: torch.Tensor  # [k] int64: the row's breakers (0: none)
    dry_multiplier: torch.Tensor  # [k] fp32; 0: no DRY on this row
    dry_base: torch.Tensor  # [k] fp32
    dry_allowed_length: torch.Tensor  # [k] int64
    dry_window_start: torch.Tensor  # [k] int64: the first position DRY looks at
    # The latest multi-token breaker among the tokens the host knows: its head's position (-1:
    # none) and its tail's length.
    dry_sequence_head: torch.Tensor  # [k] int64
    dry_sequence_tail_len: torch.Tensor  # [k] int64
    dry_max_exponent: torch.Tensor  # [k] int64; 0: unclamped
    prompt_len: torch.Tensor  # [k] int64
    penalty_start: torch.Tensor  # [k] int64: the first position the counted penalties see
    presence: torch.Tensor  # [k] fp32
    frequency: torch.Tensor  # [k] fp32
    repetition: torch.Tensor  # [k] fp32
    # [3, e] int64: (row, token, tail length) of each token that, as the row's pending last
    # token, would end a multi-token breaker that is then the latest; None when there are none.
    pending_breaks: torch.Tensor | None
    lz_penalty: torch.Tensor  # [k] fp32; 0: off
    any_counted: bool
    any_dry: bool
    any_lz: bool


class _History(NamedTuple):
    """The history of `r`'s rows, gathered once for every penalty of the step."""

    tokens: torch.Tensor  # [k, width] int64
    matches: torch.Tensor | None  # [k, width] int64; None when no row uses DRY or LZ
    positions: torch.Tensor  # [width] int64
    lengths: torch.Tensor  # [k, 1] int64


def apply_repeat_penalties(logits: torch.Tensor, r: RepeatPenalties) -> None:
    """Apply the penalties of `r`'s rows to their logits, in place."""
    # logits: [num_rows, vocab_size] fp32
    width = r.max_len
    sub = logits.index_select(0, r.rows)  # [k, vocab_size]
    h = _History(
        tokens=r.tokens[r.slots, :width],
        matches=r.matches[r.slots, :width].long() if r.any_dry or r.any_lz else None,
        positions=torch.arange(width, device=logits.device),
        lengths=r.lengths.unsqueeze(1),
    )
    if r.any_counted:
        sub = _counted(sub, r, h)
    if r.any_dry:
        _dry(sub, r, h)
    if r.any_lz:
        _lz(sub, r, h)
    logits.index_copy_(0, r.rows, sub)


def _counted(sub: torch.Tensor, r: RepeatPenalties, h: _History) -> torch.Tensor:
    """The repetition, frequency and presence penalties; a row with none comes back as it was."""
    # sub: [k, vocab_size]
    k, vocab_size = sub.shape
    tokens, positions = h.tokens, h.positions
    seen = (positions >= r.penalty_start.unsqueeze(1)) & (positions < h.lengths)
    in_output = seen & (positions >= r.prompt_len.unsqueeze(1))
    # Tokens outside are counted in a spare column, dropped.
    counts = torch.zeros(k, vocab_size + 1, device=sub.device)
    counts.scatter_add_(1, torch.where(in_output, tokens, vocab_size), in_output.float())
    counts = counts[:, :vocab_size]
    was_seen = torch.zeros(k, vocab_size + 1, dtype=torch.bool, device=sub.device)
    was_seen.scatter_(1, torch.where(seen, tokens, vocab_size), True)
    repetition = r.repetition.unsqueeze(1)
    repeated = torch.where(sub > 0, sub / repetition, sub * repetition)
    sub = torch.where(was_seen[:, :vocab_size], repeated, sub)
    sub -= r.frequency.unsqueeze(1) * counts
    sub -= r.presence.unsqueeze(1) * (counts > 0)
    return sub


def _subtract_max(sub: torch.Tensor, token_ids: torch.Tensor, penalty: torch.Tensor) -> None:
    """Each row's logit of each token in `token_ids` loses the largest `penalty` given it."""
    # token_ids, penalty: [k, m]; a penalty of 0 changes nothing
    sub.scatter_reduce_(1, token_ids, sub.gather(1, token_ids) - penalty, reduce="amin")


def _dry(sub: torch.Tensor, r: RepeatPenalties, h: _History) -> None:
    tokens, matches, positions, lengths = h
    assert matches is not None
    start = r.dry_window_start.unsqueeze(1)
    rep_limit = _rep_limit(r, h)
    # Position p (its repeat length) and the token after it, the one that would extend it.
    p = positions[:-1]
    repeat_len = torch.minimum(matches[:, :-1], rep_limit.unsqueeze(1))
    repeat_len = torch.minimum(repeat_len, p - start + 1)
    allowed = r.dry_allowed_length.unsqueeze(1)
    on = (
        (p >= start)
        & (p <= lengths - 2)
        & (repeat_len >= allowed)
        & (r.dry_multiplier > 0).unsqueeze(1)
    )
    following = torch.where(on, tokens[:, 1:], 0)
    on &= ~r.single_breakers[r.breaker_set.unsqueeze(1), following]
    exponent = repeat_len - allowed
    max_exponent = r.dry_max_exponent.unsqueeze(1)
    exponent = torch.where(max_exponent > 0, torch.minimum(exponent, max_exponent), exponent)
    penalty = r.dry_multiplier.unsqueeze(1) * r.dry_base.unsqueeze(1) ** exponent.float()
    _subtract_max(sub, following, torch.where(on, penalty, 0.0))


def _rep_limit(r: RepeatPenalties, h: _History) -> torch.Tensor:
    """llama.cpp's `rep_limit` of each row: how far back from the end a repeat may reach, up to
    the latest breaker in DRY's window (the latest head; of one head's sequences the longest),
    else the window's length."""
    tokens, _, positions, lengths = h
    # (one before the window limits nothing the window does not)
    single = r.single_breakers[r.breaker_set.unsqueeze(1), tokens] & (positions < lengths)
    single_head = torch.where(single, positions, -1).amax(dim=1)  # [k]; -1: none
    head, tail_len = r.dry_sequence_head, r.dry_sequence_tail_len
    if r.pending_breaks is not None:
        # The pending last token ends a sequence the host found later than its latest: of those
        # it ends, the latest head is the shortest tail's.
        rows, token_ids, lens = r.pending_breaks
        last = tokens.gather(1, lengths - 1).squeeze(1)  # [k]
        hit = last.index_select(0, rows) == token_ids
        none = torch.full_like(tail_len, NO_TAIL)
        shortest = none.scatter_reduce(0, rows, torch.where(hit, lens, NO_TAIL), reduce="amin")
        found = shortest < NO_TAIL
        head = torch.where(found, r.lengths - 1 - shortest, head)
        tail_len = torch.where(found, shortest, tail_len)
    window_len = r.lengths - r.dry_window_start
    sequence = (head >= single_head) & (head >= r.dry_window_start)
    return torch.where(
        sequence,
        r.lengths - 1 - head - tail_len,
        torch.where(single_head >= 0, r.lengths - 1 - single_head, window_len),
    )


def _lz(sub: torch.Tensor, r: RepeatPenalties, h: _History) -> None:
    tokens, matches, positions, lengths = h
    assert matches is not None
    start = (lengths - LZ_WINDOW_LEN).clamp(min=0)
    on = (positions >= start) & (positions < lengths) & (r.lz_penalty > 0).unsqueeze(1)
    # A match ending at q: as long as the context before q matches the end (plus q itself),
    # within the buffer and the window.
    before = torch.nn.functional.pad(matches[:, :-1], (1, 0))  # matches[q - 1]
    longest = torch.minimum(before.clamp(max=LZ_BUFFER_LEN - 1) + 1, positions - start + 1)
    longest = longest.clamp(min=1).float()
    log_distance = (lengths - positions).clamp(min=1).float().log()
    # (ln d + ln l) / l first rises then falls with l: its least is at l = 1 or the longest.
    cost = torch.minimum(log_distance, (log_distance + longest.log()) / longest)
    saved = (math.log(sub.shape[-1]) - cost).clamp(min=0)
    penalty = torch.where(on, r.lz_penalty.unsqueeze(1) * saved, 0.0)
    _subtract_max(sub, torch.where(on, tokens, 0), penalty)
