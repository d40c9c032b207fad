"""Continuous batching with chunked prefill and preemption, in the order a policy sets.

Each step the scheduler gives running requests their next tokens first, oldest first; when the
KV pool runs dry it preempts the running request the policy names (fifo: the newest) and puts it
at the front of the queue: its blocks are either copied to the host pool and copied back when it
resumes (`swap_space.py`, when that is cheaper and there is room), or freed and its tokens
recomputed. Then, if nothing was
preempted and the policy allows it this step, it admits waiting requests in the policy's order
(fifo: arrival; `scheduling_policy.py`) while the token budget, `max_prefill_tokens`,
`max_batch_size` and `max_num_seqs` allow; prefix-cache hits count as computed tokens. A step's
one-token chunks (decodes) come first in its output, for attention to run them as one decode
batch.

A step's tokens count as computed, and its samples as pending, as soon as it is scheduled; its
result comes back through `update()`. So the next step can be scheduled before that result is
known (async scheduling): a decode then feeds the pending token, which only the device knows, and
a request whose pending tokens end it by length sits the step out. When the result shows that a
request stopped, what the step after computed for it is dropped.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Callable

from metrale.config import SchedulerConfig
from metrale.engine import watchdog
from metrale.engine.kv_cache_manager import KVCacheManager
from metrale.engine.messages import EngineOutput, FinishReason
from metrale.engine.request import Request, RequestStatus
from metrale.engine.scheduling_policy import PrefillBudget, make_policy
from metrale.engine.speculation.speculator import NgramSpeculator
from metrale.engine.step import (
    PENDING_TOKEN_ID,
    ModelRunnerOutput,
    ScheduledChunk,
    SchedulerOutput,
    TokenHistory,
)
from metrale.engine.step_time import prefill_work
from metrale.engine.swap_space import SwapSpace


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache: KVCacheManager,
        clock: Callable[[], float] = time.monotonic,
        swap: SwapSpace | None = None,
        speculator: NgramSpeculator | None = None,
    ) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.swap = swap
        self.speculator = speculator
        self.policy = make_policy(config.policy, config.tbt_deadline_ms)
        self.clock = clock
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0  # computed once, dropped by a preemption, computed again
        self._swap_out: list[tuple[int, int]] = []  # this step's (device, host) block copies
        self._swap_in: list[tuple[int, int]] = []  # and (host, device)
        self.preempted_ids: list[str] = []  # since the caller last cleared it (the metrics)
        self._finished_ids: list[str] = []
        # Requests whose steps are decided on the host from their tokens so far (a grammar, a
        # thinking budget): the few that can make async scheduling wait.
        self._host_decided: dict[str, Request] = {}
        self._deadlines: list[tuple[float, str]] = []  # a heap of (deadline_s, request_id)
        self.num_thinking_loops_closed = 0  # by the watchdog, since the caller last took them
        # When the last step's result came back, while requests were running (else None; and
        # always None for a policy that does not learn step times): the time to the next is
        # what that step took, as its decodes saw it.
        self._busy_since_s: float | None = None
        self._last_prefill_work = (0, 0.0)  # of the step scheduled last (step_time.py)

    def add_request(self, request: Request) -> None:
        if self.speculator is not None:
            request.speculates = self.speculator.can_speculate(request.sampling_params)
        self.waiting.append(request)
        self.requests[request.request_id] = request
        if request.is_host_decided:
            self._host_decided[request.request_id] = request
        if request.deadline_s is not None:
            heapq.heappush(self._deadlines, (request.deadline_s, request.request_id))

    def expire(self) -> list[EngineOutput]:
        """Abort every request past its deadline (`--request-timeout`, enforced here too, so a
        request ends even when the API process that would cancel it is stuck)."""
        outputs = []
        now = self.clock()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, request_id = heapq.heappop(self._deadlines)
            if (output := self.abort_request(request_id)) is not None:
                outputs.append(output)
        return outputs

    def needs_pending_tokens(self) -> bool:
        """Whether the next step can only be scheduled once the steps in flight are back: a
        request is decided on the host from its tokens so far (a grammar, a thinking budget
        about to run out, drafts that would pay at this batch size)."""
        return any(self._waits(r) for r in self._host_decided.values())

    def _waits(self, request: Request) -> bool:
        if not request.needs_pending_tokens:
            return False
        if request.sampling_params.structured is not None or request.thinking_may_end:
            return True
        assert self.speculator is not None  # it would wait only to draft
        return self.speculator.worth_waiting(request, len(self.running))

    def abort_request(self, request_id: str) -> EngineOutput | None:
        """End a request wherever it is; its blocks are free before the next step."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        self._finish(request, FinishReason.ABORT)
        return EngineOutput(
            request_id, [], [], FinishReason.ABORT, request.num_cached_prompt_tokens, request.timing
        )

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    def schedule(self) -> SchedulerOutput:
        token_budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        scheduled: list[Request] = []
        preempted = False
        has_drafts = False
        now = self.clock()
        # The policy may hold every prefill back this step (slai, while a decode nears its
        # deadline): new prompts are not admitted, and prompts being prefilled wait a step.
        # It also sizes the step's prefill (slai: to what keeps the step within its deadline).
        prefills = self.policy.may_admit(self.running, now)
        prefill_budget = self.policy.prefill_budget(self.config.max_prefill_tokens)
        if not prefills:
            prefill_budget.hold()

        i = 0
        while i < len(self.running) and len(chunks) < self.config.max_batch_size:
            request = self.running[i]
            start = request.num_computed_tokens
            num_new = self._num_tokens_to_compute(
                self._num_unscheduled(request), token_budget, prefill_budget, start
            )
            if num_new == 0:
                i += 1
                continue
            drafts = []
            if num_new == 1 and request.speculates:
                drafts = self._drafts(request, token_budget - 1, len(self.running))
                has_drafts |= bool(drafts)
            while not self.kv_cache.allocate(request, num_new + len(drafts)):
                # only a request not yet scheduled this step can give up its blocks
                victim = self.policy.victim(self.running[i:])
                self.running.remove(victim)
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            else:
                chunks.append(self._schedule_chunk(request, num_new, drafts))
                scheduled.append(request)
                token_budget -= num_new + len(drafts)
                if num_new > 1:
                    prefill_budget.spend(start, num_new)
                i += 1

        room = min(
            self.config.max_batch_size - len(chunks), self.config.max_num_seqs - len(self.running)
        )
        candidates: list[Request] = []
        if self.waiting and not preempted and room > 0 and prefills:
            candidates = self.policy.admission_order(self.waiting, room)
        for request in candidates:
            if request.status is RequestStatus.SWAPPED:
                num_new = self._swap_in_blocks(request, token_budget, prefill_budget)
            else:
                num_new = self._claim_blocks(request, token_budget, prefill_budget, now)
            if num_new == 0:
                break
            if self.waiting[0] is request:
                self.waiting.popleft()
            else:
                self.waiting.remove(request)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            start = request.num_computed_tokens
            chunks.append(self._schedule_chunk(request, num_new))
            scheduled.append(request)
            token_budget -= num_new
            if num_new > 1:
                prefill_budget.spend(start, num_new)

        if prefill_budget.spent or has_drafts:
            chunks, scheduled = _one_token_chunks_first(chunks, scheduled)
        if self.policy.learns_step_times:
            self._last_prefill_work = _prefill_work(chunks)
        finished, self._finished_ids = self._finished_ids, []
        swap_out, self._swap_out = self._swap_out, []
        swap_in, self._swap_in = self._swap_in, []
        return SchedulerOutput(chunks, finished, scheduled, swap_out, swap_in, has_drafts)

    def _claim_blocks(
        self, request: Request, token_budget: int, prefill_budget: PrefillBudget, now: float
    ) -> int:
        """Blocks for a waiting request's first chunk, after what the prefix cache holds of
        it; the chunk's size, or 0 when it does not fit."""
        cached_prefix = self.kv_cache.find_cached_prefix(request)
        num_cached = len(cached_prefix) * self.kv_cache.block_size
        num_new = self._num_tokens_to_compute(
            self._num_unscheduled(request) - num_cached, token_budget, prefill_budget, num_cached
        )
        if num_new == 0 or not self.kv_cache.allocate(request, num_new, cached_prefix):
            return 0
        request.num_computed_tokens = num_cached
        self.kv_cache.record_admission(request, num_cached)
        if request.num_preemptions == 0:
            request.num_cached_prompt_tokens = num_cached
            request.scheduled_time_s = now
        else:
            self.num_recomputed_tokens += max(request.num_dropped_tokens - num_cached, 0)
        return num_new

    def _swap_in_blocks(
        self, request: Request, token_budget: int, prefill_budget: PrefillBudget
    ) -> int:
        """Device blocks for a swapped request and its next chunk, its blocks copied back from
        the host into them (those the prefix cache still holds are taken as they are); the
        chunk's size, or 0 when it does not fit."""
        assert self.swap is not None
        num_computed = request.num_computed_tokens
        num_new = self._num_tokens_to_compute(
            self._num_unscheduled(request), token_budget, prefill_budget, num_computed
        )
        if num_new == 0:
            return 0
        num_host = len(self.swap.host_blocks(request.request_id))
        cached = self.kv_cache.find_cached_prefix(request)[:num_host]
        # Claimed as a fresh admission would (computed from the cached prefix on), then level.
        request.num_computed_tokens = 0
        num_claimed = num_computed + num_new - len(cached) * self.kv_cache.block_size
        claimed = self.kv_cache.allocate(request, num_claimed, cached)
        request.num_computed_tokens = num_computed
        if not claimed:
            return 0
        device_blocks = list(self.kv_cache.block_ids(request.request_id))
        self._swap_in += self.swap.swap_in(request.request_id, device_blocks, len(cached))
        return num_new

    def update(self, scheduled: SchedulerOutput, result: ModelRunnerOutput) -> list[EngineOutput]:
        """Give the step's sampled tokens to their requests and report what changed."""
        outputs = []
        now = self.clock()
        if self._busy_since_s is not None and any(c.num_tokens == 1 for c in scheduled.chunks):
            # A step that decoded (under a policy that learns step times: else this is None).
            # Under async scheduling the next step was launched before this one's tokens came
            # back, so they waited for that launch too: a step that prefills, launched eagerly,
            # delays the step before it. The time is the larger prefill's of the two.
            work = max(_prefill_work(scheduled.chunks), self._last_prefill_work)
            self.policy.observe_step(*work, now - self._busy_since_s)
        sampled = iter(zip(result.sampled_token_ids, result.logprobs, strict=True))
        drafted = result.accepted_draft_ids
        drafted_logprobs = result.accepted_draft_logprobs
        row = -1
        for request, chunk in zip(scheduled.requests, scheduled.chunks, strict=True):
            if not chunk.samples:
                continue
            token_id, logprobs = next(sampled)
            row += 1
            if request.is_finished:  # it stopped or was aborted while this step ran
                continue
            request.num_pending_tokens -= 1
            token_ids = [token_id]
            given_logprobs = [] if logprobs is None else [logprobs]
            if chunk.draft_token_ids:  # the rejected drafts' KV is computed again
                assert drafted is not None and self.speculator is not None
                accepted = drafted[row]
                request.num_computed_tokens -= len(chunk.draft_token_ids) - len(accepted)
                self.speculator.record(request, len(chunk.draft_token_ids), len(accepted))
                token_ids = [*accepted, token_id]
                if logprobs is not None and drafted_logprobs is not None:
                    given_logprobs = [*drafted_logprobs[row], logprobs]
            first = request.num_output_tokens == 0
            num_offered = len(token_ids)
            token_ids, finish_reason = self._give_tokens(request, token_ids, now)
            if finish_reason is None:  # a thinking block closed early: computed again
                request.num_computed_tokens -= num_offered - len(token_ids)
                if request.speculates and not chunk.draft_token_ids:
                    assert self.speculator is not None
                    self.speculator.observe(request)
            del given_logprobs[len(token_ids) :]  # a stop among the drafts cuts the rest
            request.output_logprobs.extend(given_logprobs)
            outputs.append(
                EngineOutput(
                    request.request_id,
                    token_ids,
                    given_logprobs,
                    finish_reason,
                    request.num_cached_prompt_tokens,
                    # the engine's milestones are all known once it has its first token
                    request.timing if first else None,
                    request.stop_reason,
                )
            )
        if scheduled.chunks and self.policy.learns_step_times:
            self._busy_since_s = now if self.running else None
        return outputs

    def _give_tokens(
        self, request: Request, token_ids: list[int], now: float
    ) -> tuple[list[int], FinishReason | None]:
        """Append a step's tokens to the request up to the first that ends it, or that makes
        the watchdog force a thinking block's end next (the tokens after it were sampled
        without that); those tokens, and why it ended (None: it goes on)."""
        request.last_token_time_s = now
        if request.num_output_tokens == 0:
            request.first_token_time_s = now
        for i, token_id in enumerate(token_ids):
            request.append_output_token(token_id)
            finish_reason = self._check_stop(request, token_id)
            if finish_reason is not None:
                self._finish(request, finish_reason)
                return token_ids[: i + 1], finish_reason
            if request.closing_thinking:
                return token_ids[: i + 1], None
        return token_ids, None

    @staticmethod
    def _num_tokens_to_compute(
        num_remaining: int, token_budget: int, prefill_budget: PrefillBudget, start_pos: int
    ) -> int:
        num_new = min(num_remaining, token_budget)
        if num_new > 1:
            num_new = prefill_budget.fits(start_pos, num_new)
        return max(num_new, 0)

    def _num_unscheduled(self, request: Request) -> int:
        """Tokens of the request no step has computed yet; none once its pending tokens end it."""
        if request.num_pending_tokens and self._reaches_length(request, request.num_pending_tokens):
            return 0
        return request.num_tokens + request.num_pending_tokens - request.num_computed_tokens

    def _reaches_length(self, request: Request, num_pending: int) -> bool:
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None and request.num_output_tokens + num_pending >= max_tokens:
            return True
        return request.num_tokens + num_pending >= self.config.max_seq_len

    def _drafts(self, request: Request, max_tokens: int, num_seqs: int) -> list[int]:
        """Drafts for a speculating request's decode in a step of about `num_seqs` decodes, as
        many as its limits leave room for."""
        if self.speculator is None or request.num_pending_tokens:
            return []
        params = request.sampling_params
        if request.num_output_tokens < params.min_tokens:
            return []  # stops are banned position by position until then
        room = self.config.max_seq_len - request.num_tokens - 1
        if params.max_tokens is not None:
            room = min(room, params.max_tokens - request.num_output_tokens - 1)
        return request.drafts_decided_alike(
            self.speculator.propose(request, min(max_tokens, room), num_seqs)
        )

    def _schedule_chunk(
        self, request: Request, num_new: int, drafts: list[int] | None = None
    ) -> ScheduledChunk:
        """The request's next `num_new` tokens (then its drafts), counted as computed (and
        sampled) from now."""
        start = request.num_computed_tokens
        end = start + num_new
        params = request.sampling_params
        banned: tuple[int, ...] = ()
        if request.num_scheduled_output_tokens < params.min_tokens:
            banned = params.stop_token_ids + (() if params.ignore_eos else request.eos_token_ids)
        thinking = params.thinking
        if (
            thinking is not None
            and not request.inside_thinking
            and request.num_thinking_tokens >= thinking.max_tokens
        ):  # the budget is spent: no new block, it would be closed at once
            banned += (thinking.start_token_id,)
        samples = end == request.num_tokens + request.num_pending_tokens
        history = None
        if samples and params.reads_history:
            history = TokenHistory(request.prompt_token_ids, request.output_token_ids)
        structured = None if request.inside_thinking else params.structured
        opener = None
        if (
            structured is not None
            and thinking is not None
            and request.num_scheduled_output_tokens == 0
            and request.num_thinking_tokens < thinking.max_tokens
        ):
            opener = thinking.start_token_id
        token_ids = request.all_token_ids[start:end]
        if end > request.num_tokens:
            token_ids += [PENDING_TOKEN_ID] * (end - max(start, request.num_tokens))
        drafts = drafts or []
        token_ids += drafts
        request.num_computed_tokens = end + len(drafts)
        request.num_pending_tokens += samples
        return ScheduledChunk(
            request_id=request.request_id,
            token_ids=token_ids,
            start_pos=start,
            block_ids=self.kv_cache.block_ids(request.request_id),
            samples=samples,
            sampling_params=params,
            banned_token_ids=banned,
            token_history=history,
            forced_token_id=thinking.end_token_id if request.thinking_budget_spent else None,
            structured=structured,
            thinking_opener=opener,
            draft_token_ids=tuple(drafts),
        )

    def _check_stop(self, request: Request, token_id: int) -> FinishReason | None:
        params = request.sampling_params
        looping = request.loop_detector is not None and request.loop_detector.push(token_id)
        if looping and request.inside_thinking:  # the thinking watchdog: close it, go on
            request.close_looping_thinking()
            self.num_thinking_loops_closed += 1
            looping = False
        # The token just sampled is output number `num_output_tokens`; stops count past min_tokens.
        if request.num_output_tokens > params.min_tokens:
            is_eos = not params.ignore_eos and token_id in request.eos_token_ids
            if is_eos or token_id in params.stop_token_ids:
                return FinishReason.STOP
            if looping:
                request.stop_reason = watchdog.STOP_REASON
                return FinishReason.STOP
        if self._reaches_length(request, 0):
            return FinishReason.LENGTH
        return None

    def _preempt(self, request: Request) -> None:
        """Free a running request's device blocks: swapped to the host when that is cheaper
        than recomputing its tokens (and fits), else dropped, to be recomputed."""
        num_computed = request.num_computed_tokens
        num_blocks = self.kv_cache.num_blocks_needed(num_computed)
        if self.swap is not None and self.swap.prefers_swap(num_blocks, num_computed):
            blocks = list(self.kv_cache.block_ids(request.request_id)[:num_blocks])
            self._swap_out += self.swap.swap_out(request.request_id, blocks)
            request.status = RequestStatus.SWAPPED
        else:
            request.status = RequestStatus.PREEMPTED
            request.num_dropped_tokens = num_computed
            request.num_computed_tokens = 0
        self.kv_cache.free(request)
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.preempted_ids.append(request.request_id)
        self.waiting.appendleft(request)

    def _finish(self, request: Request, reason: FinishReason) -> None:
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._host_decided.pop(request.request_id, None)
        if self.speculator is not None:
            self.speculator.finish(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.kv_cache.free(request)
        if self.swap is not None:
            self.swap.free(request.request_id)
        del self.requests[request.request_id]
        self._finished_ids.append(request.request_id)


def _prefill_work(chunks: list[ScheduledChunk]) -> tuple[int, float]:
    return prefill_work((c.start_pos, c.num_tokens) for c in chunks if c.num_tokens > 1)


def _one_token_chunks_first(
    chunks: list[ScheduledChunk], requests: list[Request]
) -> tuple[list[ScheduledChunk], list[Request]]:
    """Reorder a mixed step so its decodes (with their drafts, if any) lead, each kind in its
    order: attention runs them as one decode batch, with a kernel made for a query row per
    sequence (a decode with drafts is laid out as a sequence per row)."""
    order = sorted(range(len(chunks)), key=lambda i: not chunks[i].is_decode)
    return [chunks[i] for i in order], [requests[i] for i in order]
