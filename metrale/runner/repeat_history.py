"""The token history that DRY and the LZ penalty read, kept on the device for the requests that
use them.

Both penalties ask how the end of the sequence repeats earlier text. For each position `p`
before the last, `matches[p]` is the length of the longest common suffix of the sequence up to
`p` and the whole sequence (llama.cpp's DRY computes it afresh each step, by the Z-algorithm on
the reversed context). Appending a token `t` updates every position at once:

    matches'[p] = matches[p - 1] + 1 if tokens[p] == t else 0

so the runner appends each sampled token on the device right after sampling it, and the next
step reads an up-to-date history without the host ever seeing that token: under async scheduling
these requests never make a step wait. A request's row (its slot) is filled once from the host,
at its first sampling step; it stays through preemption and swap and is freed when the request
finishes. Only the requests that use DRY or the LZ penalty hold a slot.

DRY's sequence breakers are the one thing decided on the host: where the latest breaker lies in
the tokens the host knows (`BreakerTracker`, kept as tokens arrive), and which tokens would end
a breaker if the step's pending token were one of them; the device settles the pending token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from metrale.engine.step import ScheduledChunk, TokenHistory
from metrale.runner.repeat_penalties import (
    LZ_WINDOW_LEN,
    RepeatPenalties,
    dry_max_exponent,
)
from metrale.sampling_params import DryBreakers, SamplingParams


def suffix_matches(tokens: Sequence[int]) -> np.ndarray:
    """`m[p]`, for each position `p < n - 1`: how many tokens the sequence up to `p` shares at
    its end with the whole sequence (the Z-function of the reversed sequence); `m[n - 1] = 0`."""
    r = list(reversed(tokens))
    n = len(r)
    z = [0] * n
    left = right = 0  # the Z-box [left, right) found so far
    for k in range(1, n):
        length = min(right - k, z[k - left]) if k < right else 0
        while k + length < n and r[length] == r[k + length]:
            length += 1
        z[k] = length
        if k + length > right:
            left, right = k, k + length
    return np.asarray(z[::-1], dtype=np.int32)  # z[n-1-p] is p's match; z[0] (the end) is 0


class TokenView:
    """A request's prompt and output ids read as one sequence, without joining them."""

    def __init__(self, history: TokenHistory) -> None:
        self.prompt, self.output = history.prompt_token_ids, history.output_token_ids

    def __len__(self) -> int:
        return len(self.prompt) + len(self.output)

    def __getitem__(self, i: int) -> int:
        n = len(self.prompt)
        return self.prompt[i] if i < n else self.output[i - n]

    def window(self, start: int, end: int) -> list[int]:
        n = len(self.prompt)
        return self.prompt[start : min(end, n)] + self.output[max(start - n, 0) : end - n]


class BreakerTracker:
    """The latest DRY sequence breaker in a request's known tokens, as llama.cpp's step 1 finds
    it scanning back from the end: the latest head whose whole sequence is present, and of the
    sequences with that head the longest. Kept up to date by scanning only new tokens."""

    def __init__(self, breakers: DryBreakers) -> None:
        self.single = frozenset(breakers.single)
        self.by_last: dict[int, list[tuple[int, tuple[int, ...]]]] = {}  # tail end -> (head, tail)
        self.by_head: dict[int, list[tuple[int, ...]]] = {}
        for head, *tail in breakers.sequences:
            self.by_last.setdefault(tail[-1], []).append((head, tuple(tail)))
            self.by_head.setdefault(head, []).append(tuple(tail))
        self.tail_lens = sorted({len(sequence) - 1 for sequence in breakers.sequences})
        self.num_scanned = 0
        self.latest: tuple[int, int] = (-1, 0)  # (head position, tail length); head -1: none

    def scan(self, tokens: TokenView, num_known: int) -> None:
        for k in range(self.num_scanned, num_known):
            token = tokens[k]
            if token in self.single:
                self.latest = max(self.latest, (k, 0))
            for head, tail in self.by_last.get(token, ()):
                start = k - len(tail)
                if start >= 0 and tokens[start] == head and _follows(tokens, start + 1, tail):
                    self.latest = max(self.latest, (start, len(tail)))
        self.num_scanned = max(self.num_scanned, num_known)

    def rep_limit(self, num_tokens: int, window_len: int) -> int:
        """llama.cpp's `rep_limit`: the longest repeat the breakers allow, for a context of
        `num_tokens` tokens whose last `window_len` DRY looks at."""
        head, tail_len = self.latest
        if head < num_tokens - window_len:
            return window_len
        return num_tokens - 1 - head - tail_len

    def pending_breaks(self, tokens: TokenView, num_known: int) -> list[int]:
        """The tokens that, taken next (at position `num_known`), would end a multi-token
        breaker that is then the latest. (A single-token breaker there always is: the device
        checks those.)"""
        found = []
        for tail_len in self.tail_lens:
            start = num_known - tail_len
            if start < 0:
                continue
            for tail in self.by_head.get(tokens[start], ()):
                if (
                    len(tail) == tail_len
                    and (start, tail_len) > self.latest
                    and _follows(tokens, start + 1, tail[:-1])
                ):
                    found.append(tail[-1])
        return found


def _follows(tokens: TokenView, start: int, ids: Sequence[int]) -> bool:
    return all(tokens[start + i] == t for i, t in enumerate(ids))


@dataclass(frozen=True, slots=True)
class _RowInputs:
    """What the host knows of one row of the step."""

    slot: int
    length: int  # tokens in the slot, a pending one included
    pending: bool
    breaker_set: int
    window_start: int  # the first position DRY looks at
    rep_limit: int  # llama.cpp's, before the pending token (if any) is seen
    pending_breaks: list[int]


@dataclass(slots=True)
class Slot:
    index: int
    length: int  # tokens on the device, a pending one included
    breakers: BreakerTracker | None  # None: the request has no DRY (or no breakers)
    breaker_set: int  # its row of `single_breakers` (0: none)


@dataclass
class RepeatHistory:
    """Slots of `max_seq_len` tokens on `device`, one per request using DRY or the LZ penalty:
    `tokens[slot, :length]` and `matches[slot, :length]` (see the module's docstring)."""

    max_seq_len: int
    vocab_size: int
    device: torch.device
    num_slots: int = 8
    slots: dict[str, Slot] = field(default_factory=dict)

    def __post_init__(self) -> None:
        width = self.max_seq_len + 1
        self.tokens = torch.zeros(self.num_slots, width, dtype=torch.int64, device=self.device)
        self.matches = torch.zeros(self.num_slots, width, dtype=torch.int32, device=self.device)
        self._free = list(range(self.num_slots - 1, -1, -1))
        # Row i: which tokens are single-token breakers of the i-th breaker set seen (row 0: none).
        self.single_breakers = torch.zeros(1, self.vocab_size, dtype=torch.bool, device=self.device)
        self._breaker_sets: dict[DryBreakers, int] = {}

    def free(self, request_id: str) -> None:
        slot = self.slots.pop(request_id, None)
        if slot is not None:
            self._free.append(slot.index)

    def prepare(self, rows: list[tuple[int, ScheduledChunk]]) -> RepeatPenalties:
        """The step's penalty inputs for these sampling rows (each `(row, chunk)`); counts the
        token each will sample as appended."""
        inputs = [self._row_inputs(chunk) for _, chunk in rows]
        breaks = [(i, token) for i, row in enumerate(inputs) for token in row.pending_breaks]
        params = [chunk.sampling_params for _, chunk in rows]
        return RepeatPenalties(
            tokens=self.tokens,
            matches=self.matches,
            single_breakers=self.single_breakers,
            rows=self._tensor([row for row, _ in rows]),
            slots=self._tensor([row.slot for row in inputs]),
            lengths=self._tensor([row.length for row in inputs]),
            max_len=max(row.length for row in inputs),
            pending=self._tensor([row.pending for row in inputs], torch.bool),
            breaker_set=self._tensor([row.breaker_set for row in inputs]),
            dry_multiplier=self._tensor(
                [p.dry_multiplier if p.uses_dry else 0.0 for p in params], torch.float32
            ),
            dry_base=self._tensor([p.dry_base for p in params], torch.float32),
            dry_allowed_length=self._tensor([p.dry_allowed_length for p in params]),
            dry_window_start=self._tensor([row.window_start for row in inputs]),
            dry_rep_limit=self._tensor([row.rep_limit for row in inputs]),
            dry_max_exponent=self._tensor([dry_max_exponent(p.dry_base) for p in params]),
            pending_break_rows=self._tensor([i for i, _ in breaks]) if breaks else None,
            pending_break_tokens=self._tensor([t for _, t in breaks]) if breaks else None,
            lz_penalty=self._tensor([p.lz_penalty for p in params], torch.float32),
            any_dry=any(p.uses_dry for p in params),
            any_lz=any(p.lz_penalty > 0 for p in params),
        )

    def _row_inputs(self, chunk: ScheduledChunk) -> _RowInputs:
        assert chunk.token_history is not None
        params = chunk.sampling_params
        tokens = TokenView(chunk.token_history)
        slot = self.slots.get(chunk.request_id)
        if slot is None:
            slot = self._new_slot(chunk.request_id, tokens, params)
        n, num_known = slot.length, len(tokens)
        pending = n > num_known  # its last token was sampled by the step still in flight
        last_n = params.dry_penalty_last_n
        window_len = n if last_n < 0 else min(n, last_n)
        rep_limit, breaks = window_len, []
        if slot.breakers is not None:
            slot.breakers.scan(tokens, num_known)
            rep_limit = slot.breakers.rep_limit(n, window_len)
            if pending:
                breaks = slot.breakers.pending_breaks(tokens, num_known)
        slot.length += 1  # the token this step samples, appended on the device
        return _RowInputs(
            slot.index, n, pending, slot.breaker_set, n - window_len, rep_limit, breaks
        )

    def append(self, repeats: RepeatPenalties, sampled_ids: torch.Tensor) -> None:
        """Append each row's sampled token (`sampled_ids`: [num_rows] of the whole batch)."""
        token_ids = sampled_ids.index_select(0, repeats.rows)  # [k]
        slots, lengths, width = repeats.slots, repeats.lengths, repeats.max_len
        tokens = self.tokens[slots, :width]  # [k, width]
        matches = self.matches[slots, :width]
        before = torch.nn.functional.pad(matches[:, :-1], (1, 0))  # matches[p - 1]
        # (past a row's length this writes values no step reads before they are overwritten)
        extends = tokens == token_ids.unsqueeze(1)
        self.matches[slots, :width] = torch.where(extends, before + 1, 0)
        self.tokens[slots, lengths] = token_ids
        self.matches[slots, lengths] = 0

    def _new_slot(self, request_id: str, tokens: TokenView, params: SamplingParams) -> Slot:
        if not self._free:
            self._grow()
        index = self._free.pop()
        n = len(tokens)
        # Matches are computed from `start` on: DRY's window and the LZ window lie after it.
        reach = 0
        if params.uses_dry:
            reach = n if params.dry_penalty_last_n < 0 else params.dry_penalty_last_n
        if params.lz_penalty > 0:
            reach = max(reach, LZ_WINDOW_LEN)
        start = max(n - reach - 1, 0)
        token_ids = tokens.window(0, n)
        matches = np.zeros(n, dtype=np.int32)
        matches[start:] = suffix_matches(token_ids[start:])
        self.tokens[index, :n] = torch.tensor(token_ids, dtype=torch.int64).to(self.device)
        self.matches[index, :n] = torch.from_numpy(matches).to(self.device)
        breakers = params.dry_breakers
        tracker = None
        breaker_set = 0
        if params.uses_dry and breakers is not None and not breakers.empty:
            tracker = BreakerTracker(breakers)
            breaker_set = self._breaker_set(breakers)
        slot = Slot(index, n, tracker, breaker_set)
        self.slots[request_id] = slot
        return slot

    def _breaker_set(self, breakers: DryBreakers) -> int:
        index = self._breaker_sets.get(breakers)
        if index is None:
            index = self.single_breakers.shape[0]
            row = torch.zeros(1, self.vocab_size, dtype=torch.bool)
            row[0, [t for t in breakers.single if t < self.vocab_size]] = True
            self.single_breakers = torch.cat([self.single_breakers, row.to(self.device)])
            self._breaker_sets[breakers] = index
        return index

    def _grow(self) -> None:
        old = self.num_slots
        self.num_slots *= 2
        self.tokens = torch.cat([self.tokens, torch.zeros_like(self.tokens)])
        self.matches = torch.cat([self.matches, torch.zeros_like(self.matches)])
        self._free.extend(range(self.num_slots - 1, old - 1, -1))

    def _tensor(self, values: list, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)
