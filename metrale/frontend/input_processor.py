"""Turn a prompt (text or token ids) and sampling parameters into an `EngineRequest`."""

from __future__ import annotations

import time

from metrale.engine.messages import EngineRequest
from metrale.frontend.dry_breakers import resolve_dry_breakers
from metrale.sampling_params import SamplingParams
from metrale.tokenizer import Tokenizer

Prompt = str | list[int]


class InputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def process(
        self, request_id: str, prompt: Prompt, params: SamplingParams
    ) -> tuple[str | None, EngineRequest]:
        """(prompt text if given as text, the engine request)."""
        if isinstance(prompt, str):
            text: str | None = prompt
            token_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            text, token_ids = None, list(prompt)
        else:
            raise ValueError(
                f"prompt must be a string or a list of token ids, not {type(prompt).__name__}"
            )
        params = resolve_dry_breakers(params, self.tokenizer)
        return text, EngineRequest(request_id, token_ids, params, time.monotonic())
