"""What a caller gets back for a request, in vLLM's shape so its users know it."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = the most likely token
    decoded_token: str | None = None


# One position: token id -> its logprob; the sampled token and the top N.
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[PositionLogprobs] | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(o.finished for o in self.outputs)
