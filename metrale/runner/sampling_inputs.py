"""What the sampler reads each step, built from the step's sampling chunks.

One row per sampled position: a chunk's own, and one more for each of its drafts. Where some
row draws at random, the per-row parameters (`temperature`, `top_k`, `top_p`, `min_p`) and the
rows' draws go through the runner's pinned input buffers, two copies a step; the rarer inputs
(logit bias, truncation, penalties, drafts, grammar masks) are built only for the rows that ask
for them, and are None (or absent) when none does, so a plain batch pays for no pass it does
not use.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, replace

import numpy as np
import torch

from metrale.engine.step import ScheduledChunk
from metrale.runner.input_buffers import InputBuffers, to_device
from metrale.runner.random_draws import NUM_DRAWS, RandomDraws, Seeds
from metrale.runner.repeat_history import RepeatHistory
from metrale.runner.repeat_penalties import RepeatPenalties
from metrale.runner.sampler import Drafts, LogitBias, RandomRows, SamplingMetadata
from metrale.runner.structured_output import GrammarRows, StructuredOutputs
from metrale.runner.truncation import Truncation
from metrale.sampling_params import SamplingParams

_NO_DRAWS = torch.empty(0, NUM_DRAWS, dtype=torch.float64)


@dataclass(frozen=True)
class ParamRows:
    """What a step's rows' sampling parameters alone give the sampler (`random` without its
    draws, which follow the rows' positions), kept for the next step with the same rows."""

    params: list[SamplingParams]
    random: RandomRows | None  # None: every row is greedy
    seeds: Seeds  # of the seeded rows that draw (not greedy)
    max_num_logprobs: int | None
    logit_bias: LogitBias | None
    truncation: Truncation | None


class SamplingInputs:
    """The sampler's inputs for each step, and the per-request state they read across steps:
    the penalised requests' histories on the device
    (`repeat_history`, made for the first request that reads one) and the grammar matchers
    (`structured_outputs`). A request's state lives until `drop`, when it finishes.

    It fills the runner's pinned buffers: build a step's inputs after the runner has waited
    for the previous step's copies, and before it records this step's."""

    def __init__(
        self,
        buffers: InputBuffers,
        vocab_size: int,
        max_seq_len: int,
        device: torch.device,
        structured_outputs: StructuredOutputs | None = None,
    ) -> None:
        self.buffers = buffers
        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len
        self.device = device
        self.structured_outputs = structured_outputs
        self.repeat_history: RepeatHistory | None = None  # made for the first DRY or LZ request
        self.random_draws = RandomDraws()
        self._last_rows: ParamRows | None = None  # the last step's, for a step with its rows

    def drop(self, request_id: str) -> None:
        """Free a finished request's history slot and grammar matcher."""
        if self.repeat_history is not None:
            self.repeat_history.free(request_id)
        if self.structured_outputs is not None:
            self.structured_outputs.drop(request_id)

    def prepare(
        self, chunks: list[ScheduledChunk], has_drafts: bool
    ) -> tuple[SamplingMetadata, np.ndarray | None]:
        """The sampler's inputs for the step's sampling chunks, and where each chunk's rows
        start (with one past the last row at the end) when some chunk has drafts, else None
        (one row per chunk)."""
        rows, drafts, first_rows, positions = chunks, None, None, None
        if has_drafts:
            # A chunk with drafts samples at each of their positions too: one row each.
            rows = [c for c in chunks for _ in range(1 + len(c.draft_token_ids))]
            first_rows = np.cumsum([0] + [1 + len(c.draft_token_ids) for c in chunks])
            drafts = self.drafts(chunks, first_rows)
            positions = [
                c.start_pos + c.num_tokens - len(c.draft_token_ids) + j
                for c in chunks
                for j in range(1 + len(c.draft_token_ids))
            ]
        grammar = self.grammar(chunks, first_rows)
        return self.metadata(rows, drafts, grammar, positions), first_rows

    def record(self, metadata: SamplingMetadata, token_ids: torch.Tensor) -> None:
        """Append a step's samples to the penalised rows' histories, on the device."""
        if metadata.penalties is not None:
            self.repeat_history.append(metadata.penalties, token_ids)

    def metadata(
        self,
        chunks: list[ScheduledChunk],
        drafts: Drafts | None = None,
        grammar: dict | None = None,
        positions: list[int] | None = None,
    ) -> SamplingMetadata:
        """The sampler's inputs for one row per chunk in `chunks`, each sampling the token at
        its position in `positions` (None: the one after the chunk)."""
        rows = self._rows_of([c.sampling_params for c in chunks])
        random = None
        if rows.random is not None:
            if positions is None:
                positions = [c.start_pos + len(c.token_ids) for c in chunks]
            b = self.buffers
            self.random_draws.fill(b.draws.np, rows.seeds, positions)
            random = replace(rows.random, draws=b.draws.copy_to_device(len(chunks)))
        return SamplingMetadata(
            random=random,
            banned=[
                (row, c.banned_token_ids) for row, c in enumerate(chunks) if c.banned_token_ids
            ],
            max_num_logprobs=rows.max_num_logprobs,
            logit_bias=rows.logit_bias,
            truncation=rows.truncation,
            drafts=drafts,
            penalties=self._penalties(chunks),
            forced=[
                (row, c.forced_token_id)
                for row, c in enumerate(chunks)
                if c.forced_token_id is not None
            ],
            **(grammar or {}),
        )

    def _rows_of(self, params: list[SamplingParams]) -> ParamRows:
        """What the rows' sampling parameters alone give the sampler, on the device: the last
        step's again when its rows had the same parameters in the same order (decodes, step
        after step), so that such a step copies only its draws."""
        last = self._last_rows
        if (
            last is not None
            and len(last.params) == len(params)
            and all(map(operator.is_, last.params, params))
        ):
            return last
        logprobs = [p.logprobs for p in params if p.logprobs is not None]
        self._last_rows = ParamRows(
            params=params,
            random=self._random_params(params),
            seeds=Seeds.of([None if p.greedy else p.seed for p in params]),
            max_num_logprobs=max(logprobs) if logprobs else None,
            logit_bias=self._logit_bias(params),
            truncation=self._truncation(params),
        )
        return self._last_rows

    def _random_params(self, params: list[SamplingParams]) -> RandomRows | None:
        """The per-row parameters of a batch where some row is not greedy, on the device (the
        draws still to come); None, and nothing copied, when every row is greedy."""
        if all(p.greedy for p in params):
            return None
        b = self.buffers
        n = len(params)
        vocab_size = self.vocab_size
        b.row_params.np[:n] = [
            (p.temperature, p.top_k or vocab_size, p.top_p, p.min_p) for p in params
        ]
        temperature, top_k, top_p, min_p = b.row_params.copy_to_device(n).unbind(1)
        return RandomRows(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            draws=_NO_DRAWS,
            any_greedy=any(p.greedy for p in params),
            any_top_k_or_p=any(p.top_k > 0 or p.top_p < 1.0 for p in params),
            any_min_p=any(p.min_p > 0 for p in params),
        )

    def drafts(self, chunks: list[ScheduledChunk], first_rows: np.ndarray) -> Drafts | None:
        """The rows of sampled (not greedy) chunks that check a draft (a chunk's rows start at
        `first_rows`); None when none does."""
        rows, token_ids = [], []
        for chunk, row in zip(chunks, first_rows.tolist(), strict=False):
            drafts = chunk.draft_token_ids
            if drafts and not chunk.sampling_params.greedy:
                rows += range(row, row + len(drafts))
                token_ids += drafts
        if not rows:
            return None
        return Drafts(self._tensor(rows, torch.int64), self._tensor(token_ids, torch.int64))

    def grammar(self, chunks: list[ScheduledChunk], first_rows: np.ndarray | None) -> dict:
        """The grammar bitmask of the constrained chunks' rows (a chunk's rows start at
        `first_rows`, or one row each when None): sampler fields, empty when none is."""
        rows = [
            GrammarRows(
                row if first_rows is None else int(first_rows[row]),
                c.request_id,
                c.structured,
                c.thinking_opener,
                c.draft_token_ids,
            )
            for row, c in enumerate(chunks)
            if c.structured
        ]
        if not rows:
            return {}
        if self.structured_outputs is None:
            raise RuntimeError("structured output requested but the engine has no grammar backend")
        num_rows = len(chunks) if first_rows is None else int(first_rows[-1])
        bitmask, grammar_rows = self.structured_outputs.bitmask(rows, num_rows, self.device)
        return {"grammar_bitmask": bitmask, "grammar_rows": grammar_rows}

    def _truncation(self, params: list[SamplingParams]) -> Truncation | None:
        """The sampled rows that use top-nσ, typical or XTC; None when none does."""
        rows = [row for row, p in enumerate(params) if p.truncates and not p.greedy]
        if not rows:
            return None
        used = [params[row] for row in rows]
        return Truncation(
            rows=self._tensor(rows, torch.int64),
            top_n_sigma=self._tensor([p.top_n_sigma for p in used], torch.float32),
            typical_p=self._tensor([p.typical_p for p in used], torch.float32),
            xtc_threshold=self._tensor([p.xtc_threshold for p in used], torch.float32),
            xtc_probability=self._tensor([p.xtc_probability for p in used], torch.float32),
            any_top_n_sigma=any(p.top_n_sigma > 0 for p in used),
            any_typical=any(p.typical_p < 1.0 for p in used),
            any_xtc=any(p.xtc_probability > 0 for p in used),
        )

    def _penalties(self, chunks: list[ScheduledChunk]) -> RepeatPenalties | None:
        """The rows with a penalty, over their histories on the device."""
        rows = [(row, c) for row, c in enumerate(chunks) if c.sampling_params.reads_history]
        if not rows:
            return None
        if self.repeat_history is None:
            self.repeat_history = RepeatHistory(self.max_seq_len, self.vocab_size, self.device)
        return self.repeat_history.prepare(rows)

    def _logit_bias(self, params: list[SamplingParams]) -> LogitBias | None:
        rows, token_ids, values = [], [], []
        for row, p in enumerate(params):
            for token_id, value in (p.logit_bias or {}).items():
                rows.append(row)
                token_ids.append(token_id)
                values.append(value)
        if not rows:
            return None
        return LogitBias(
            rows=self._tensor(rows, torch.int64),
            token_ids=self._tensor(token_ids, torch.int64),
            values=self._tensor(values, torch.float32),
        )

    def _tensor(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        return to_device(values, dtype, self.device)
