"""Fold the engine's per-step token outputs into `RequestOutput`s, detokenizing as they come."""

from __future__ import annotations

from dataclasses import dataclass

from metrale.engine.request import EngineOutput, TokenLogprobs
from metrale.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from metrale.sampling_params import SamplingParams
from metrale.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class _RequestState:
    output: RequestOutput
    completion: CompletionOutput
    detokenizer: IncrementalDetokenizer
    params: SamplingParams


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _RequestState] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        index: int = 0,
    ) -> RequestOutput:
        completion = CompletionOutput(
            index=index,
            text="",
            token_ids=[],
            logprobs=[] if params.logprobs is not None else None,
        )
        output = RequestOutput(request_id, prompt, prompt_token_ids, [completion])
        detokenizer = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
        self._states[request_id] = _RequestState(output, completion, detokenizer, params)
        return output

    def process(self, engine_output: EngineOutput) -> RequestOutput | None:
        """Apply one engine output; returns the request's output when it has finished."""
        state = self._states.get(engine_output.request_id)
        if state is None:
            return None
        completion = state.completion
        completion.token_ids.extend(engine_output.new_token_ids)
        completion.text += state.detokenizer.push(engine_output.new_token_ids)
        if completion.logprobs is not None:
            completion.logprobs.extend(self._logprobs(lp) for lp in engine_output.new_logprobs)
        state.output.num_cached_tokens = engine_output.num_cached_tokens
        if engine_output.finish_reason is None:
            return None
        completion.text += state.detokenizer.finish()
        completion.finish_reason = engine_output.finish_reason.value
        del self._states[engine_output.request_id]
        return state.output

    def _logprobs(self, lp: TokenLogprobs) -> PositionLogprobs:
        position = {lp.token_id: Logprob(lp.logprob, lp.rank, self._token_text(lp.token_id))}
        for rank, (token_id, logprob) in enumerate(lp.top, start=1):
            position.setdefault(token_id, Logprob(logprob, rank, self._token_text(token_id)))
        return position

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)
