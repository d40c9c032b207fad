"""Turn the engine's per-step token outputs into text deltas, one request at a time.

For each request it keeps the incremental detokenizer and the stop-string matcher; each engine
output becomes a `CompletionDelta` (new tokens, new text, new logprobs, and how it finished).
The offline `LLM` folds deltas into a `RequestOutput`; the server streams them.

A caller that wants completions only whole (the offline `LLM`) asks for that per request: one
without stop strings, whose text nothing can end early, then keeps its tokens as they come and
is decoded once, when it finishes, so the work between engine steps is a list extend a request.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from metrale.engine.messages import EngineOutput, FinishReason, TokenLogprobs
from metrale.frontend.stop_strings import StopStringMatcher
from metrale.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from metrale.sampling_params import SamplingParams
from metrale.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class CompletionDelta:
    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or stop token that ended it
    watchdog: str | None = None  # the engine watchdog that ended it (engine/watchdog.py)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # True when the frontend ended the request (a stop string): the engine must drop it too.
    abort_in_engine: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def extend(self, later: CompletionDelta) -> None:
        """Take in the request's next delta, as if the two had come as one (a caller that fell
        behind gets what queued for it in one piece): tokens, text and logprobs appended, how
        it finished and its cache count from `later`."""
        self.token_ids = self.token_ids + later.token_ids  # not in place: the engine's list
        self.text += later.text
        if later.logprobs is not None:
            self.logprobs = (self.logprobs or []) + later.logprobs
        self.finish_reason, self.stop_reason = later.finish_reason, later.stop_reason
        self.watchdog = later.watchdog
        self.num_cached_tokens = later.num_cached_tokens
        self.abort_in_engine = self.abort_in_engine or later.abort_in_engine


@dataclass
class _RequestState:
    params: SamplingParams
    num_prompt_tokens: int
    detokenizer: IncrementalDetokenizer
    stops: StopStringMatcher
    num_output_tokens: int = 0
    finished: bool = field(default=False)
    # Decoded whole at the end (`OutputProcessor.add_request`'s `whole`): the tokens and
    # logprobs so far, None where the request is decoded as it goes.
    held_token_ids: list[int] | None = None
    held_logprobs: list[TokenLogprobs] | None = None


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _RequestState] = {}

    def add_request(
        self,
        request_id: str,
        num_prompt_tokens: int,
        params: SamplingParams,
        whole: bool = False,
    ) -> None:
        """`whole`: the caller folds the deltas into a completion and reads it only finished,
        so a request without stop strings gets a single delta, when it finishes, with all of
        its tokens, logprobs and text (the text decoded once: the deltas of a push a step
        concatenate to the same decode)."""
        held = whole and not params.stop
        self._states[request_id] = _RequestState(
            params=params,
            num_prompt_tokens=num_prompt_tokens,
            detokenizer=IncrementalDetokenizer(
                self.tokenizer, params.skip_special_tokens, params.kept_special_token_ids
            ),
            stops=StopStringMatcher(params.stop, params.include_stop_str_in_output),
            held_token_ids=[] if held else None,
            held_logprobs=[] if held else None,
        )

    def remove_request(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def process(self, out: EngineOutput) -> CompletionDelta | None:
        """The delta one engine output makes; None for a request no longer tracked."""
        state = self._states.get(out.request_id)
        if state is None:
            return None
        if state.held_token_ids is not None:
            state.held_token_ids += out.new_token_ids
            state.held_logprobs += out.new_logprobs  # type: ignore[operator]
            if out.finish_reason is None:
                return None
            out = msgspec.structs.replace(
                out, new_token_ids=state.held_token_ids, new_logprobs=state.held_logprobs
            )
        engine_finished = out.finish_reason is not None
        text = state.detokenizer.push(out.new_token_ids)
        if engine_finished:
            text += state.detokenizer.finish()
        text, matched_stop = state.stops.feed(text, final=engine_finished)
        state.num_output_tokens += len(out.new_token_ids)
        delta = CompletionDelta(
            request_id=out.request_id,
            token_ids=out.new_token_ids,
            text=text,
            logprobs=None
            if state.params.logprobs is None
            else [self._logprobs(lp) for lp in out.new_logprobs],
            num_prompt_tokens=state.num_prompt_tokens,
            num_cached_tokens=out.num_cached_tokens,
        )
        if matched_stop is not None:
            delta.finish_reason, delta.stop_reason = FinishReason.STOP.value, matched_stop
            delta.abort_in_engine = not engine_finished
        elif engine_finished:
            delta.finish_reason = out.finish_reason.value  # type: ignore[union-attr]
            last = out.new_token_ids[-1] if out.new_token_ids else None
            if out.stop_reason is not None:  # a watchdog ended it
                delta.stop_reason = delta.watchdog = out.stop_reason
            elif last in state.params.stop_token_ids:
                delta.stop_reason = last
        if delta.finished:
            del self._states[out.request_id]
        return delta

    def _logprobs(self, lp: TokenLogprobs) -> PositionLogprobs:
        position = {lp.token_id: Logprob(lp.logprob, lp.rank, self._token_text(lp.token_id))}
        for rank, (token_id, logprob) in enumerate(lp.top, start=1):
            position.setdefault(token_id, Logprob(logprob, rank, self._token_text(token_id)))
        return position

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def fold(output: RequestOutput, delta: CompletionDelta) -> None:
    """Add a delta to the single completion of a `RequestOutput` being assembled."""
    completion: CompletionOutput = output.outputs[0]
    completion.token_ids.extend(delta.token_ids)
    completion.text += delta.text
    if delta.logprobs is not None:
        completion.logprobs = (completion.logprobs or []) + delta.logprobs
    completion.finish_reason = delta.finish_reason
    completion.stop_reason = delta.stop_reason
    output.num_cached_tokens = delta.num_cached_tokens
