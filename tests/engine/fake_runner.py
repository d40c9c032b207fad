"""A scripted stand-in for the model runner: the boundary the scheduler tests fake."""

from __future__ import annotations

from metrale.engine.step import ModelRunnerOutput, SchedulerOutput


def scripted_token(request_id: str, position: int) -> int:
    """A deterministic 'next token' that depends on the request and the position only."""
    return (sum(map(ord, request_id)) * 31 + position * 7) % 97 + 3


class FakeRunner:
    def __init__(self) -> None:
        self.steps: list[SchedulerOutput] = []

    def execute(self, scheduled: SchedulerOutput) -> ModelRunnerOutput:
        self.steps.append(scheduled)
        tokens = [
            scripted_token(c.request_id, c.start_pos + c.num_tokens)
            for c in scheduled.chunks
            if c.samples
        ]
        return ModelRunnerOutput(tokens, [None] * len(tokens))
