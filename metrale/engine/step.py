"""The contract between scheduling and execution: what one step computes, and what it returns."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from metrale.engine.messages import TokenLogprobs
from metrale.sampling_params import SamplingParams, StructuredOutput

if TYPE_CHECKING:
    from metrale.engine.request import Request

# Stands for a token sampled by the step still in flight: the runner feeds it from the device.
PENDING_TOKEN_ID = -1


class TokenHistory(NamedTuple):
    """A request's prompt and output ids, shared with the request rather than copied.

    Valid while the step runs: the scheduler's `update()` appends the sampled token to
    `output_token_ids` afterwards.
    """

    prompt_token_ids: list[int]
    output_token_ids: list[int]


@dataclass(slots=True)  # not frozen: one is built per row per step, and frozen costs 3.7x
class ScheduledChunk:
    """The tokens of one request that this step computes (never changed once built).

    `token_ids` start at position `start_pos` (the request's computed tokens before the step);
    the last may be `PENDING_TOKEN_ID`, sampled by the previous step and not yet seen by the host.
    When `samples` is true the chunk reaches the request's last token, so the step samples the
    next one; a chunk in the middle of a long prompt samples nothing. `token_history` is set
    only on sampling chunks whose params have penalties (the counted ones, DRY, the LZ
    penalty), so requests without them cost nothing.
    """

    request_id: str
    token_ids: list[int]
    start_pos: int
    block_ids: Sequence[int]  # the request's block table (the KV manager's live array)
    samples: bool
    sampling_params: SamplingParams
    # Tokens this step may not sample: stops before min_tokens, a spent thinking budget's opener.
    banned_token_ids: tuple[int, ...] = ()
    token_history: TokenHistory | None = None  # what the penalties count
    forced_token_id: int | None = None  # the only token this step may sample (thinking budget)
    structured: StructuredOutput | None = None  # the grammar this step's token must follow
    # A token the grammar also allows: the thinking opener, while the reply may still open a
    # thinking block before its grammar starts (the grammar applies after the block).
    thinking_opener: int | None = None
    # Speculative drafts: the last of `token_ids`, guesses of the tokens after the one this
    # chunk samples; the step checks each against what it would sample in its place.
    draft_token_ids: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_decode(self) -> bool:
        """It computes one token after its context, then its drafts (if any): attention runs it
        as one-row sequences, one per token (`ModelRunner._fill_inputs`)."""
        return len(self.token_ids) == 1 + len(self.draft_token_ids)


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk]
    # Requests that ended since the previous step: the runner drops its state for them.
    finished_request_ids: list[str] = field(default_factory=list)
    # The scheduler's own request of each chunk, for its `update()`; the runner never reads them.
    requests: list[Request] = field(default_factory=list)
    # KV blocks to copy before the step runs, in this order: preempted requests' blocks out to
    # the host pool as (device, host) pairs, resuming requests' back as (host, device).
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    has_drafts: bool = False  # some chunk carries speculative drafts

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass(frozen=True)
class ModelRunnerOutput:
    """One sampled token (and its logprobs, when asked) per chunk that samples, in chunk order;
    before it, the chunk's drafts that its step accepted."""

    sampled_token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    # Per sampling chunk, the drafts accepted before the sampled token; None: no chunk drafted.
    accepted_draft_ids: list[list[int]] | None = None
    # Their logprobs, where the chunk asks for logprobs (else empty lists); None: no chunk drafted.
    accepted_draft_logprobs: list[list[TokenLogprobs]] | None = None
    # How long the device took (see `StepStats`), how long the host waited for it, and whether
    # it ran as a CUDA graph replay.
    device_s: float | None = None
    wait_s: float = 0.0
    cuda_graph: bool = False
    swap_s: float | None = None  # the device's time for the step's swap copies, if it had any
