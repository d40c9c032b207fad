"""Logprobs in the two OpenAI shapes: chat's `content` list and completions' parallel lists."""

from __future__ import annotations

from typing import Any

from metrale.outputs import PositionLogprobs
from metrale.tokenizer import Tokenizer

# The least logprob reported. -inf (a token ruled out) and NaN (a broken forward) are not JSON
# numbers, and OpenAI's clients expect one: they are reported as this (vLLM's floor too).
LOGPROB_FLOOR = -9999.0


def _reported(logprob: float) -> float:
    return logprob if logprob >= LOGPROB_FLOOR else LOGPROB_FLOOR  # NaN compares False


def _token_text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _top(position: PositionLogprobs, num_top: int) -> list[tuple[int, float]]:
    """The top `num_top` (token id, logprob) by rank; the sampled token is in the position
    even when it ranks lower, and is then left out here."""
    ranked = sorted(
        (lp.rank, t, lp.logprob)
        for t, lp in position.items()
        if lp.rank is not None and lp.rank <= num_top
    )
    return [(t, _reported(lp)) for _, t, lp in ranked]


def chat_logprobs(
    token_ids: list[int], positions: list[PositionLogprobs], tokenizer: Tokenizer, num_top: int
) -> list[dict[str, Any]]:
    content = []
    for token_id, position in zip(token_ids, positions, strict=True):
        text = _token_text(tokenizer, token_id)
        content.append(
            {
                "token": text,
                "logprob": _reported(position[token_id].logprob),
                "bytes": list(text.encode()),
                "top_logprobs": [
                    {
                        "token": (t := _token_text(tokenizer, tid)),
                        "logprob": lp,
                        "bytes": list(t.encode()),
                    }
                    for tid, lp in _top(position, num_top)
                ],
            }
        )
    return content


def completion_logprobs(
    token_ids: list[int],
    positions: list[PositionLogprobs],
    tokenizer: Tokenizer,
    num_top: int,
    text_offset: int,
) -> dict[str, Any]:
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token_id, position in zip(token_ids, positions, strict=True):
        text = _token_text(tokenizer, token_id)
        tokens.append(text)
        token_logprobs.append(_reported(position[token_id].logprob))
        top_logprobs.append({_token_text(tokenizer, t): lp for t, lp in _top(position, num_top)})
        offsets.append(text_offset)
        text_offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }
