"""Which requests speculate, their drafts, and how many of the drafts the steps accepted.

The scheduler asks `propose()` for a decode's drafts; they ride in its chunk after the token the
step samples anyway (`ScheduledChunk.draft_token_ids`), so one forward computes the logits at
every draft position. The runner keeps the longest prefix of drafts that equals what it samples
at their positions, plus the token it samples after them: greedy, the argmax, exactly the tokens
decoding one at a time would give; sampled, by rejection sampling (`runner/sampler.py`), tokens
of the same distribution. The scheduler then takes back the computed count of
the rejected drafts, whose KV slots the next steps overwrite.

Drafts are checked only where they pay: a request whose recent drafts were accepted less often
than the step's batch size needs (`cost_model.py`) does not draft that step; one whose drafts
keep failing pauses drafting a while, longer each time.

A grammar masks each draft's row as it would be after the drafts before it, so a draft the
grammar rejects is rejected (`runner/structured_output.py`). A thinking budget's state is the
chunk's: drafts stop before a thinking block's start or end and before the budget runs out
(`Request.drafts_decided_alike`). Stop tokens still banned by `min_tokens` and the penalties (they
read the device's history one token a step) keep a request to one token a step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from metrale.engine.messages import SpecDecodeStats
from metrale.engine.request import Request
from metrale.engine.speculation.config import SpeculativeConfig
from metrale.engine.speculation.cost_model import VerifyCosts
from metrale.engine.speculation.ngram import NgramIndex
from metrale.engine.speculation.shared_lookup import SharedLookup
from metrale.sampling_params import SamplingParams

# A request whose latest ATTEMPTS drafting steps gained fewer than MIN_ACCEPTED_PER_ATTEMPT tokens
# a step pauses drafting for a while, longer each time: a drafting step checks its drafts eagerly.
# Under async scheduling a lookup that finds nothing counts as an attempt too: to look, the step
# waited for the one before.
ATTEMPTS = 4
MIN_ACCEPTED_PER_ATTEMPT = 0.5
FIRST_PAUSE, LONGEST_PAUSE = 8, 256  # tokens
# Before its drafts are checked, a request's acceptance (per draft token) is taken as PRIOR,
# weighted as PRIOR_WEIGHT draft tokens; its checked drafts outweigh it soon.
PRIOR, PRIOR_WEIGHT = 0.5, 2.0


@dataclass
class _Drafting:
    """A speculating request's n-gram index and how its recent drafts fared."""

    index: NgramIndex
    recent: deque[int] = field(default_factory=lambda: deque(maxlen=ATTEMPTS))  # accepted
    pause: int = FIRST_PAUSE  # tokens, the next time it pauses
    # Its recent drafting steps' (drafted, accepted) tokens, for its acceptance
    checked: deque[tuple[int, int]] = field(default_factory=lambda: deque(maxlen=2 * ATTEMPTS))
    # The drafts it would have checked after its first `shadow_at` tokens, in a step where it
    # drafted none (`observe`), checked against its tokens as they come; how the latest such
    # would-be attempts fared (accepted tokens)
    shadow: list[int] = field(default_factory=list)
    shadow_at: int = 0
    shadow_recent: deque[int] = field(default_factory=lambda: deque(maxlen=ATTEMPTS))
    # Whether each of its latest lookups (real or shadow) found drafts
    lookups: deque[bool] = field(default_factory=lambda: deque(maxlen=4 * ATTEMPTS))

    @property
    def acceptance(self) -> float:
        """Accepted tokens per draft token, lately."""
        drafted = sum(d for d, _ in self.checked) + PRIOR_WEIGHT
        return (sum(a for _, a in self.checked) + PRIOR * PRIOR_WEIGHT) / drafted

    @property
    def hit_rate(self) -> float:
        """The share of its lookups that found drafts, lately."""
        return (sum(self.lookups) + PRIOR * PRIOR_WEIGHT) / (len(self.lookups) + PRIOR_WEIGHT)


class NgramSpeculator:
    """The n-gram index of every speculating request, kept as its tokens arrive."""

    def __init__(
        self,
        config: SpeculativeConfig,
        shared: SharedLookup | None = None,
        async_scheduling: bool = False,
        costs: VerifyCosts | None = None,
    ) -> None:
        self.config = config
        self.shared = shared
        self.async_scheduling = async_scheduling
        self.costs = costs  # None: every request drafts, whatever the batch
        self.num_priced_out = 0  # lookups skipped: at the step's batch size drafts would not pay
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * config.num_speculative_tokens
        self._requests: dict[str, _Drafting] = {}

    @property
    def stats(self) -> SpecDecodeStats:
        return SpecDecodeStats(
            self.num_drafts,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            list(self.accepted_per_position),
        )

    @staticmethod
    def can_speculate(params: SamplingParams) -> bool:
        return not params.reads_history

    def propose(self, request: Request, max_tokens: int, num_seqs: int = 1) -> list[int]:
        """Up to `max_tokens` drafts after the request's tokens (all known to the host), in a
        step of about `num_seqs` decodes: none when its drafts would not pay at that size."""
        if max_tokens <= 0 or request.num_tokens < request.draft_resume_at:
            return []
        state = self._state(request)
        if not self.pays(request, num_seqs):
            self.num_priced_out += 1
            return []
        state.shadow = []  # checked for real from here
        drafts = self._lookup(request, state, min(max_tokens, self.config.num_speculative_tokens))
        if not drafts and self.async_scheduling:
            self._attempted(request, state, 0)
        return drafts

    def observe(self, request: Request) -> None:
        """A speculating request's new tokens, from a step that checked none of its drafts
        (priced out, paused, or its token pending): a shadow lookup, its drafts checked
        against the tokens as they come, with no wait and no verify. What it would have
        gained counts in the request's acceptance and hit rate, so both are still learned
        while it does not draft, and a pause ends early once its shadows would have paid."""
        state = self._state(request)
        tokens = request.all_token_ids
        if state.shadow:
            known = tokens[state.shadow_at : state.shadow_at + len(state.shadow)]
            accepted = 0
            while accepted < len(known) and known[accepted] == state.shadow[accepted]:
                accepted += 1
            if accepted == len(known) < len(state.shadow):
                return  # matching so far: the next tokens decide
            state.checked.append((len(state.shadow), accepted))
            state.shadow_recent.append(accepted)
            recent = state.shadow_recent
            if (
                len(recent) == ATTEMPTS
                and sum(recent) >= MIN_ACCEPTED_PER_ATTEMPT * ATTEMPTS
                and request.draft_resume_at > request.num_tokens
            ):
                request.draft_resume_at = 0
                state.pause = FIRST_PAUSE
        state.shadow = self._lookup(request, state, self.config.num_speculative_tokens)
        state.shadow_at = len(tokens)

    def _lookup(self, request: Request, state: _Drafting, num_tokens: int) -> list[int]:
        """Up to `num_tokens` drafts after the request's tokens: its own, else the shared
        table's."""
        index = state.index
        drafts = index.propose(num_tokens)
        if not drafts and self.shared is not None:
            drafts = self.shared.lookup(request.tenant, index.tokens)[:num_tokens]
        state.lookups.append(bool(drafts))
        return drafts

    def worth_waiting(self, request: Request, num_seqs: int) -> bool:
        """Whether async scheduling should wait for the request's pending token to look its
        drafts up: drafts found as often as its lookups find them, accepted as often as its
        drafts are, would pay at this batch size, and its tokens so far leave a match possible
        once that token is known (with a shared table, any may match)."""
        state = self._state(request)
        if self.costs is not None:
            expected = state.hit_rate * state.acceptance
            if expected < self.costs.min_acceptance(num_seqs):
                return False
        if self.shared is not None or request.num_pending_tokens != 1:
            return True
        return state.index.may_match_after_one_more()

    def _state(self, request: Request) -> _Drafting:
        """The request's drafting state, its index caught up with its tokens."""
        state = self._requests.get(request.request_id)
        if state is None:
            state = _Drafting(NgramIndex(self.config.ngram_min, self.config.ngram_max))
            self._requests[request.request_id] = state
        state.index.extend(request.all_token_ids[len(state.index) :])
        return state

    def pays(self, request: Request, num_seqs: int) -> bool:
        """Whether the request's drafts would pay in a step of about `num_seqs` decodes, by
        its acceptance so far (the prior before any check). Its tokens do not enter into it,
        so a request priced out never makes async scheduling wait for its pending tokens."""
        if self.costs is None:
            return True
        state = self._requests.get(request.request_id)
        acceptance = PRIOR if state is None else state.acceptance
        return acceptance >= self.costs.min_acceptance(num_seqs)

    def record(self, request: Request, num_drafted: int, num_accepted: int) -> None:
        """A step checked `num_drafted` drafts of the request and kept `num_accepted`."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1
        if (state := self._requests.get(request.request_id)) is not None:
            state.checked.append((num_drafted, num_accepted))
            self._attempted(request, state, num_accepted)

    @staticmethod
    def _attempted(request: Request, state: _Drafting, num_accepted: int) -> None:
        state.recent.append(num_accepted)
        if len(state.recent) < ATTEMPTS:
            return
        if sum(state.recent) >= MIN_ACCEPTED_PER_ATTEMPT * ATTEMPTS:
            state.pause = FIRST_PAUSE
            return
        request.draft_resume_at = request.num_tokens + state.pause
        state.pause = min(2 * state.pause, LONGEST_PAUSE)
        state.recent.clear()

    def finish(self, request: Request) -> None:
        """Forget a finished request's index; its text goes into the shared table."""
        self._requests.pop(request.request_id, None)
        if self.shared is not None:
            self.shared.feed(request.tenant, request.all_token_ids)
