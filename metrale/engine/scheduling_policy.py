"""What a scheduling policy decides, asked by the scheduler each step: in which order waiting
requests are admitted, whether new prompts are admitted this step at all and how many prompt
tokens it may prefill, and which running request gives up its blocks when the KV pool runs dry.

- `fifo` (the default): arrival order; the newest running request is preempted.
- `priority`: the lowest `priority` value first, then arrival (vLLM's `priority` field and
  policy); the victim is the running request of the highest value, the newest among equals.
- `slai`: deadline-aware. No prefill runs while a running request has waited 80% of the
  time-between-tokens deadline since its last token (no new prompt is admitted, and a prompt
  being prefilled in chunks waits a step), so decodes catch up first; the queue is admitted
  front first (so nothing starves), then shortest remaining prompt first; victims as fifo.
  That bounds how often a decode is late; how late, the size of each step's prefill bounds:
  a step prefills at most the prompt tokens that keep it within 80% of the deadline, by the
  step times seen so far (`step_time.py`: a late chunk of a long prompt costs more than an
  early one; `--max-prefill-tokens` alone until it knows), and at least
  SLAI_MIN_PREFILL_TOKENS, so prompts progress even when a step that prefills cannot meet
  the deadline at all. A step past twice the deadline (a kernel compiling, a swap storm) is
  not learnt from.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable
from typing import ClassVar

from metrale.engine.request import Request
from metrale.engine.step_time import StepTimeModel

POLICIES = ("fifo", "priority", "slai")
SLAI_WAIT_SHARE = 0.8  # of the deadline: a running request this close to missing it blocks prompts
SLAI_STEP_SHARE = 0.8  # of the deadline: the time a step that prefills is planned to take
SLAI_MIN_PREFILL_TOKENS = 32
SLAI_OUTLIER = 2.0  # steps longer than this many deadlines are not learnt from


class PrefillBudget:
    """What the rest of a step may prefill: `tokens`, and with a step time model, time (what
    the step may take past its base, `seconds`). The step's first chunk may take
    `min_tokens` whatever the time left."""

    def __init__(
        self,
        tokens: int,
        model: StepTimeModel | None = None,
        seconds: float = 0.0,
        min_tokens: int = 0,
    ) -> None:
        self.tokens = tokens
        self._model = model if model is not None and model.coefficients is not None else None
        self._seconds = seconds
        self._min_tokens = min_tokens
        self.spent = 0  # tokens

    def hold(self) -> None:
        """Nothing more is prefilled this step."""
        self.tokens = 0

    def fits(self, start_pos: int, wanted: int) -> int:
        """How many of `wanted` prompt tokens from `start_pos` the step may take."""
        n = min(wanted, self.tokens)
        if self._model is not None and n > 1:
            n = min(n, self._model.tokens_within(self._seconds, start_pos))
            if not self.spent:
                n = max(n, min(wanted, self.tokens, self._min_tokens))
        return max(n, 0)

    def spend(self, start_pos: int, num_tokens: int) -> None:
        self.tokens -= num_tokens
        self.spent += num_tokens
        if self._model is not None:
            self._seconds -= self._model.seconds(start_pos, num_tokens)


class SchedulingPolicy:
    """fifo: arrival order, newest running request preempted first."""

    name: ClassVar[str] = "fifo"
    # Whether the scheduler times steps for `observe_step` (only slai learns from them, so the
    # others cost the hot path nothing).
    learns_step_times: ClassVar[bool] = False

    def admission_order(self, waiting: Iterable[Request], limit: int) -> list[Request]:
        """At most `limit` waiting requests, in the order to try admitting them (the scheduler
        stops at the first that does not fit)."""
        return list(itertools.islice(waiting, limit))

    def may_admit(self, running: list[Request], now_s: float) -> bool:
        """Whether prefills may run this step (new prompts, and the chunks of those being
        prefilled)."""
        return True

    def prefill_budget(self, max_prefill_tokens: int) -> PrefillBudget:
        """What this step may prefill: at most `max_prefill_tokens`."""
        return PrefillBudget(max_prefill_tokens)

    def observe_step(self, prefill_tokens: int, pairs: float, seconds: float) -> None:
        """A step that prefilled `prefill_tokens` prompt tokens (`pairs` attention pairs,
        `step_time.prefill_work`) took `seconds` between the tokens of the requests it
        decoded."""

    def victim(self, candidates: list[Request]) -> Request:
        """The request to preempt among `candidates` (running, in admission order)."""
        return candidates[-1]


class PriorityPolicy(SchedulingPolicy):
    name: ClassVar[str] = "priority"

    def admission_order(self, waiting: Iterable[Request], limit: int) -> list[Request]:
        return heapq.nsmallest(limit, waiting, key=lambda r: (r.priority, r.arrival_time_s))

    def victim(self, candidates: list[Request]) -> Request:
        # max() keeps the first of equals: walk newest first so the newest of the lowest wins
        return max(reversed(candidates), key=lambda r: (r.priority, r.arrival_time_s))


class SlaiPolicy(SchedulingPolicy):
    name: ClassVar[str] = "slai"
    learns_step_times: ClassVar[bool] = True

    def __init__(self, tbt_deadline_s: float) -> None:
        if not tbt_deadline_s > 0:
            raise ValueError(f"tbt_deadline_ms must be > 0, got {tbt_deadline_s * 1e3:g}")
        self.tbt_deadline_s = tbt_deadline_s
        self.step_time = StepTimeModel()

    def admission_order(self, waiting: Iterable[Request], limit: int) -> list[Request]:
        it = iter(waiting)
        front = next(it, None)
        if front is None or limit < 1:
            return []
        rest = heapq.nsmallest(
            limit - 1, it, key=lambda r: (r.num_tokens - r.num_computed_tokens, r.arrival_time_s)
        )
        return [front, *rest]

    def may_admit(self, running: list[Request], now_s: float) -> bool:
        bound = SLAI_WAIT_SHARE * self.tbt_deadline_s
        return not any(
            r.last_token_time_s is not None and now_s - r.last_token_time_s >= bound
            for r in running
        )

    def prefill_budget(self, max_prefill_tokens: int) -> PrefillBudget:
        fit = self.step_time.coefficients
        if fit is None:
            return PrefillBudget(max_prefill_tokens)
        seconds = SLAI_STEP_SHARE * self.tbt_deadline_s - fit[0]
        return PrefillBudget(max_prefill_tokens, self.step_time, seconds, SLAI_MIN_PREFILL_TOKENS)

    def observe_step(self, prefill_tokens: int, pairs: float, seconds: float) -> None:
        if seconds <= SLAI_OUTLIER * self.tbt_deadline_s:
            self.step_time.observe(prefill_tokens, pairs, seconds)


def make_policy(name: str, tbt_deadline_ms: float | None = None) -> SchedulingPolicy:
    if name == "fifo":
        return SchedulingPolicy()
    if name == "priority":
        return PriorityPolicy()
    if name == "slai":
        if tbt_deadline_ms is None:
            raise ValueError("--scheduler slai needs --tbt-deadline-ms (time between tokens)")
        return SlaiPolicy(tbt_deadline_ms / 1e3)
    raise ValueError(f"--scheduler {name!r}: use one of {', '.join(POLICIES)}")
