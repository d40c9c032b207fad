"""The token history the penalties read, kept on the device for the requests that use them.

The counted penalties (presence, frequency, repetition) count its tokens. DRY and the LZ penalty
ask how the end of the sequence repeats earlier text. For each position `p`
before the last, `matches[p]` is the length of the longest common suffix of the sequence up to
`p` and the whole sequence (llama.cpp's DRY computes it afresh each step, by the Z-algorithm on
the reversed context). Appending a token `t` updates every position at once:

    matches'[p] = matches[p - 1] + 1 if tokens[p] == t else 0

so the runner appends each sampled token on the device right after sampling it, and the next
step reads an up-to-date history without the host ever seeing that token: under async scheduling
these requests never make a step wait. A request's row (its slot) is filled once from the host,
at its first sampling step; it stays through preemption and swap and is freed when the request
finishes. Only the requests that use a penalty hold a slot.

DRY's sequence breakers are the one thing decided on the host: where the latest breaker lies in
the tokens the host knows (`SequenceBreakers`, kept as tokens arrive), and which tokens would
end one if the step's pending token were one of them; the device settles the pending token, and
finds the single-token breakers itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from metrale.engine.step import ScheduledChunk, TokenHistory
from metrale.runner.input_buffers import to_device
from metrale.runner.repeat_penalties import (
    LZ_WINDOW_LEN,
    RepeatPenalties,
    dry_max_exponent,
)
from metrale.sampling_params import SamplingParams


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


class SequenceBreakers:
    """The latest of DRY's multi-token breakers wholly among a request's known tokens: its
    head's position and its tail's length, the longest tail where several share that head (as
    llama.cpp's step 1 finds a breaker scanning back from the end). Kept up to date by scanning
    only new tokens. Single-token breakers are the device's to find (`repeat_penalties.py`)."""

    def __init__(self, sequences: Sequence[tuple[int, ...]]) -> None:
        self.by_last: dict[int, list[tuple[int, tuple[int, ...]]]] = {}  # tail end -> (head, tail)
        self.by_head: dict[int, list[tuple[int, ...]]] = {}
        for head, *tail in sequences:
            self.by_last.setdefault(tail[-1], []).append((head, tuple(tail)))
            self.by_head.setdefault(head, []).append(tuple(tail))
        self.tail_lens = sorted({len(sequence) - 1 for sequence in sequences})
        self.num_scanned = 0
        self.latest: tuple[int, int] = (-1, 0)  # (head position, tail length); head -1: none

    def scan(self, tokens: TokenView, num_known: int) -> None:
        for k in range(self.num_scanned, num_known):
            for head, tail in self.by_last.get(tokens[k], ()):
                start = k - len(tail)
                if start >= 0 and tokens[start] == head and _follows(tokens, start + 1, tail):
                    self.latest = max(self.latest, (start, len(tail)))
        self.num_scanned = max(self.num_scanned, num_known)

    def pending_breaks(self, tokens: TokenView, num_known: int) -> list[tuple[int, int]]:
        """(token, tail length) for each token that, taken next (at position `num_known`),
        would end a breaker that is then the latest."""
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
                    found.append((tail[-1], tail_len))
        return found


def _follows(tokens: TokenView, start: int, ids: Sequence[int]) -> bool:
    return all(tokens[start + i] == t for i, t in enumerate(ids))


@dataclass(slots=True)
class Slot:
    index: int
    length: int  # tokens on the device, a pending one included
    sequences: SequenceBreakers | None  # None: no DRY, or no multi-token breakers
    dry_last_n: int  # -1: the whole sequence
    penalty_window: int  # the counted penalties' (0: the whole sequence)
    # Its row of `single_breakers` (0: none), DRY's allowed length and exponent clamp, the
    # prompt's length.
    ints: tuple[int, int, int, int]
    # DRY's multiplier (0: off) and base, the LZ strength; presence, frequency, repetition.
    floats: tuple[float, float, float, float, float, float]


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
        self._zero = torch.zeros((), dtype=torch.int32, device=self.device)
        # Row i: which tokens are single-token breakers of the i-th breaker set seen (row 0: none).
        self.single_breakers = torch.zeros(1, self.vocab_size, dtype=torch.bool, device=self.device)
        self._breaker_sets: dict[tuple[int, ...], int] = {}

    def free(self, request_id: str) -> None:
        slot = self.slots.pop(request_id, None)
        if slot is not None:
            self._free.append(slot.index)

    def prepare(self, rows: list[tuple[int, ScheduledChunk]]) -> RepeatPenalties:
        """The step's penalty inputs for these sampling rows (each `(row, chunk)`); counts the
        token each will sample as appended."""
        int_rows, float_rows, breaks = [], [], []
        for i, (row, chunk) in enumerate(rows):
            history = chunk.token_history
            assert history is not None
            slot = self.slots.get(chunk.request_id)
            if slot is None:
                slot = self._new_slot(chunk.request_id, TokenView(history), chunk.sampling_params)
            n = slot.length
            num_known = len(history.prompt_token_ids) + len(history.output_token_ids)
            pending = n > num_known  # its last token was sampled by the step still in flight
            window_len = n if slot.dry_last_n < 0 else min(n, slot.dry_last_n)
            penalty_start = n - min(n, slot.penalty_window) if slot.penalty_window else 0
            head, tail_len = -1, 0
            if slot.sequences is not None:
                tokens = TokenView(history)
                slot.sequences.scan(tokens, num_known)
                head, tail_len = slot.sequences.latest
                if pending:
                    found = slot.sequences.pending_breaks(tokens, num_known)
                    breaks += [(i, token, length) for token, length in found]
            slot.length = n + 1  # the token this step samples, appended on the device
            dynamic = (row, slot.index, n, pending, n - window_len, head, tail_len, penalty_start)
            int_rows.append((*dynamic, *slot.ints))
            float_rows.append(slot.floats)
        # Two copies to the device: the integers, then the floats ([field, row] each).
        ints = to_device(np.array(int_rows, dtype=np.int64).T.copy(), torch.int64, self.device)
        floats = to_device(
            np.array(float_rows, dtype=np.float32).T.copy(), torch.float32, self.device
        )
        pending_breaks = None
        if breaks:
            pending_breaks = to_device(
                np.array(breaks, dtype=np.int64).T.copy(), torch.int64, self.device
            )
        return RepeatPenalties(
            tokens=self.tokens,
            matches=self.matches,
            single_breakers=self.single_breakers,
            rows=ints[0],
            slots=ints[1],
            lengths=ints[2],
            max_len=max(r[2] for r in int_rows),
            pending=ints[3].bool(),
            dry_window_start=ints[4],
            dry_sequence_head=ints[5],
            dry_sequence_tail_len=ints[6],
            penalty_start=ints[7],
            breaker_set=ints[8],
            dry_allowed_length=ints[9],
            dry_max_exponent=ints[10],
            prompt_len=ints[11],
            dry_multiplier=floats[0],
            dry_base=floats[1],
            lz_penalty=floats[2],
            presence=floats[3],
            frequency=floats[4],
            repetition=floats[5],
            pending_breaks=pending_breaks,
            any_counted=any(f[3] != 0 or f[4] != 0 or f[5] != 1 for f in float_rows),
            any_dry=any(f[0] > 0 for f in float_rows),
            any_lz=any(f[2] > 0 for f in float_rows),
        )

    def append(self, repeats: RepeatPenalties, sampled_ids: torch.Tensor) -> None:
        """Append each row's sampled token (`sampled_ids`: [num_rows] of the whole batch)."""
        token_ids = sampled_ids.index_select(0, repeats.rows)  # [k]
        slots, lengths, width = repeats.slots, repeats.lengths, repeats.max_len
        if repeats.any_dry or repeats.any_lz:  # (the counted penalties read no matches)
            tokens = self.tokens[slots, :width]  # [k, width]
            matches = self.matches[slots, :width]
            before = torch.nn.functional.pad(matches[:, :-1], (1, 0))  # matches[p - 1]
            # (past a row's length this writes values no step reads before they are overwritten)
            extends = tokens == token_ids.unsqueeze(1)
            self.matches[slots, :width] = torch.where(extends, before + 1, 0)
            self.matches.index_put_((slots, lengths), self._zero)  # (a Python 0 would sync)
        self.tokens.index_put_((slots, lengths), token_ids)

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
        self.tokens[index, :n] = to_device(token_ids, torch.int64, self.device)
        self.matches[index, :n] = to_device(matches, torch.int32, self.device)
        breakers = params.dry_breakers
        sequences = None
        breaker_set = 0
        if params.uses_dry and breakers is not None:
            if breakers.single:
                breaker_set = self._breaker_set(breakers.single)
            if breakers.sequences:
                sequences = SequenceBreakers(breakers.sequences)
        slot = Slot(
            index,
            n,
            sequences,
            params.dry_penalty_last_n,
            params.repetition_penalty_window,
            (
                breaker_set,
                params.dry_allowed_length,
                dry_max_exponent(params.dry_base),
                len(tokens.prompt),
            ),
            (
                params.dry_multiplier if params.uses_dry else 0.0,
                params.dry_base,
                params.lz_penalty,
                params.presence_penalty,
                params.frequency_penalty,
                params.repetition_penalty,
            ),
        )
        self.slots[request_id] = slot
        return slot

    def _breaker_set(self, single: tuple[int, ...]) -> int:
        index = self._breaker_sets.get(single)
        if index is None:
            index = self.single_breakers.shape[0]
            row = torch.zeros(1, self.vocab_size, dtype=torch.bool)
            row[0, [t for t in single if t < self.vocab_size]] = True
            self.single_breakers = torch.cat([self.single_breakers, row.to(self.device)])
            self._breaker_sets[single] = index
        return index

    def _grow(self) -> None:
        old = self.num_slots
        self.num_slots *= 2
        self.tokens = torch.cat([self.tokens, torch.zeros_like(self.tokens)])
        self.matches = torch.cat([self.matches, torch.zeros_like(self.matches)])
        self._free.extend(range(self.num_slots - 1, old - 1, -1))
