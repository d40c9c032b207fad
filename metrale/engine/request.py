"""Engine-side state of one request.

The invariant everything else leans on: `num_computed_tokens` catches up with
`num_tokens + num_pending_tokens`. Prefill, chunked prefill, decode and recompute after
preemption are all "compute the tokens not yet computed"; a step that brings a request level
samples one more token, which makes it one behind again.

A sampled token is pending from the moment its step is scheduled until its id comes back from
the device. Scheduling counts it already (the step computes it, `num_computed_tokens` moves at
schedule time), which is what lets async scheduling plan step N+1 while step N still runs: the
runner feeds a pending token to the model straight from the device.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from metrale.engine.messages import FinishReason, RequestTiming, TokenLogprobs
from metrale.engine.watchdog import LoopDetector
from metrale.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # its blocks freed: its tokens are computed again
    SWAPPED = "swapped"  # its blocks on the host: copied back when it resumes
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time_s: float = field(default_factory=time.monotonic)
    priority: int = 0  # the priority policy serves lower values first
    deadline_s: float | None = None  # aborted at the first step past it (kept when preempted)
    speculates: bool = False  # its decodes may carry drafts (engine/speculation/)
    draft_resume_at: int = 0  # no drafts before it has this many tokens (a pause, speculator.py)
    tenant: str | None = None  # the API key's client (the shared lookup keeps tenants apart)

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_pending_tokens: int = 0  # sampled by steps in flight, ids not yet known to the host
    num_cached_prompt_tokens: int = 0  # prompt tokens served by the prefix cache, first admission
    num_preemptions: int = 0
    num_dropped_tokens: int = 0  # computed tokens its latest recompute preemption threw away
    finish_reason: FinishReason | None = None
    # The engine's milestones of it (time.monotonic()), for the metrics.
    queued_time_s: float = field(default_factory=time.monotonic)
    scheduled_time_s: float | None = None
    first_token_time_s: float | None = None
    last_token_time_s: float | None = None  # when update() last gave it a token (slai)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        thinking = self.sampling_params.thinking
        # Thinking-budget state; it follows from the tokens, so it survives preemption as is.
        self.inside_thinking = thinking is not None and thinking.starts_inside
        self.num_thinking_tokens = 0
        # The content-loop watchdog's state; it too follows from the output tokens alone.
        repeats = self.sampling_params.content_loop_min_repeats
        self.loop_detector = LoopDetector(repeats) if repeats else None
        self.closing_thinking = False  # the watchdog saw the thinking loop: </think> is forced
        self.stop_reason: str | None = None  # why the engine stopped it, beyond its finish reason

    @property
    def timing(self) -> RequestTiming:
        return RequestTiming(
            self.queued_time_s,
            self.scheduled_time_s,
            self.first_token_time_s,
        )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        thinking = self.sampling_params.thinking
        if thinking is None:
            return
        if not self.inside_thinking:
            self.inside_thinking = token_id == thinking.start_token_id
        elif token_id == thinking.end_token_id:
            self.inside_thinking = self.closing_thinking = False
        else:
            self.num_thinking_tokens += 1

    @property
    def num_scheduled_output_tokens(self) -> int:
        """Output tokens known or pending: what length limits count."""
        return len(self.output_token_ids) + self.num_pending_tokens

    @property
    def is_host_decided(self) -> bool:
        """Whether its steps are shaped on the host from its tokens so far: a grammar's mask,
        a thinking budget's forced close, drafts proposed from the tokens. (The penalties read a
        history kept on the device.)"""
        params = self.sampling_params
        return params.structured is not None or params.thinking is not None or self.speculates

    @property
    def needs_pending_tokens(self) -> bool:
        """Whether its next step must wait for the ids of its pending tokens.

        A grammar, drafts and a thinking budget about to run out are decided on the host from
        the tokens so far; other requests go on without knowing them.
        """
        if self.num_pending_tokens == 0 or not self.is_host_decided:
            return False
        return (
            self.sampling_params.structured is not None or self.thinking_may_end or self.may_draft
        )

    @property
    def may_draft(self) -> bool:
        """A speculating request past its pause: it looks its drafts up in its tokens, so it
        needs the pending ones."""
        return self.speculates and self.num_tokens + self.num_pending_tokens >= self.draft_resume_at

    @property
    def thinking_may_end(self) -> bool:
        """Its pending tokens may spend its thinking budget (or the watchdog closes the block).
        Outside a block they cannot: with the budget spent the scheduler bans opening another."""
        thinking = self.sampling_params.thinking
        return (
            thinking is not None
            and self.inside_thinking
            and (
                self.closing_thinking
                or self.num_thinking_tokens + self.num_pending_tokens >= thinking.max_tokens
            )
        )

    @property
    def thinking_budget_spent(self) -> bool:
        """Whether the next token must close the thinking block: its budget is spent, or the
        watchdog saw it loop."""
        thinking = self.sampling_params.thinking
        return (
            thinking is not None
            and self.inside_thinking
            and (self.closing_thinking or self.num_thinking_tokens >= thinking.max_tokens)
        )

    def drafts_decided_alike(self, drafts: list[int]) -> list[int]:
        """The drafts cut to those whose rows the step decides as it does its first: a thinking
        budget's forced close, its ban on a new block and a grammar's mask (off inside a block)
        are set per chunk, so the drafts stop before a block's start or end and before the row
        where the budget would run out; none once the next token is forced."""
        thinking = self.sampling_params.thinking
        if thinking is None:
            return drafts
        if self.thinking_budget_spent:
            return []
        num = len(drafts)
        for i, token_id in enumerate(drafts):
            if token_id in (thinking.start_token_id, thinking.end_token_id):
                num = i
                break
        if self.inside_thinking:  # row j samples thinking token number num_thinking_tokens + j
            num = min(num, thinking.max_tokens - self.num_thinking_tokens - 1)
        return drafts[: max(num, 0)]

    def close_looping_thinking(self) -> None:
        """The thinking watchdog: close the block at the next token, and watch the answer
        afresh (the loop was the thinking's)."""
        self.closing_thinking = True
        self.loop_detector = LoopDetector(self.sampling_params.content_loop_min_repeats)
