"""A scripted stand-in for the model runner: the boundary the scheduler tests fake."""

from __future__ import annotations

from metrale.engine.step import PENDING_TOKEN_ID, ModelRunnerOutput, SchedulerOutput


def scripted_token(request_id: str, position: int) -> int:
    """A deterministic 'next token' that depends on the request and the position only."""
    return (sum(map(ord, request_id)) * 31 + position * 7) % 97 + 3


class FakeRunner:
    """Samples scripted tokens; checks that a pending input token is one it sampled last step.

    `launch()` only records the step, as the real runner queues it; `collect()` gives its
    tokens, so an engine may launch the next step in between.
    """

    def __init__(self) -> None:
        self.steps: list[SchedulerOutput] = []
        self._last_sampled: dict[str, int] = {}  # request id -> position of its sampled token

    def launch(self, scheduled: SchedulerOutput) -> SchedulerOutput:
        for chunk in scheduled.chunks:
            pending = [i for i, t in enumerate(chunk.token_ids) if t == PENDING_TOKEN_ID]
            if pending:
                position = chunk.start_pos + pending[0]
                assert pending == [chunk.num_tokens - 1], "only the last token may be pending"
                assert self._last_sampled.get(chunk.request_id) == position, (
                    f"{chunk.request_id}: pending token at {position} was not sampled last step"
                )
        self._last_sampled = {
            c.request_id: c.start_pos + c.num_tokens for c in scheduled.chunks if c.samples
        }
        self.steps.append(scheduled)
        return scheduled

    def collect(self, scheduled: SchedulerOutput) -> ModelRunnerOutput:
        tokens = [
            scripted_token(c.request_id, c.start_pos + c.num_tokens)
            for c in scheduled.chunks
            if c.samples
        ]
        return ModelRunnerOutput(tokens, [None] * len(tokens))

    def execute(self, scheduled: SchedulerOutput) -> ModelRunnerOutput:
        return self.collect(self.launch(scheduled))
