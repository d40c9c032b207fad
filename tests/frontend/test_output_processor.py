"""OutputProcessor: a request read only whole (the offline `LLM`) is decoded once when it ends,
to the same tokens, text, logprobs and finish as the deltas of a request read as it streams."""

from __future__ import annotations

from pathlib import Path

import pytest

import metrale.tokenizer
from metrale.engine.messages import EngineOutput, FinishReason, TokenLogprobs
from metrale.frontend.output_processor import CompletionDelta, OutputProcessor
from metrale.sampling_params import SamplingParams
from metrale.tokenizer import Tokenizer

DEMO_DIR = Path(metrale.tokenizer.__file__).resolve().parent.parent / "demo" / "tokenizer"
TEXT = "Emoji 😀🤖 and 你好，世界 then the end."


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(DEMO_DIR)


def outputs(ids: list[int], per_step: int, finish: FinishReason, logprobs: bool):
    """The engine's outputs for `ids`, `per_step` tokens a step, the last one finished."""
    steps = [ids[i : i + per_step] for i in range(0, len(ids), per_step)]
    for n, step in enumerate(steps):
        last = n == len(steps) - 1
        yield EngineOutput(
            "r",
            step,
            [TokenLogprobs(t, -0.5, 1, [(t, -0.5), (t + 1, -1.5)]) for t in step]
            if logprobs
            else [],
            finish if last else None,
            num_cached_tokens=3,
        )


def run(tokenizer, ids, params, whole, finish=FinishReason.LENGTH, per_step=1):
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", 7, params, whole=whole)
    deltas = []
    for out in outputs(ids, per_step, finish, params.logprobs is not None):
        if (delta := processor.process(out)) is not None:
            deltas.append(delta)
    assert processor.process(EngineOutput("r", [1], [], None, 0)) is None  # no longer tracked
    return deltas


def joined(deltas: list[CompletionDelta]) -> CompletionDelta:
    first = deltas[0]
    for later in deltas[1:]:
        first.extend(later)
    return first


@pytest.mark.parametrize("logprobs", [None, 1])
@pytest.mark.parametrize("per_step", [1, 3])
def test_a_whole_request_is_one_delta_equal_to_the_streamed_ones(tokenizer, logprobs, per_step):
    ids = tokenizer.encode(TEXT)
    params = SamplingParams(max_tokens=len(ids), logprobs=logprobs)
    streamed = run(tokenizer, ids, params, whole=False, per_step=per_step)
    assert len(streamed) > 1
    [whole] = run(tokenizer, ids, params, whole=True, per_step=per_step)
    assert whole == joined(streamed)
    assert whole.text == TEXT and whole.token_ids == ids
    assert whole.finish_reason == "length" and whole.num_prompt_tokens == 7
    assert whole.num_cached_tokens == 3
    if logprobs is None:
        assert whole.logprobs is None
    else:
        assert [next(iter(p)) for p in whole.logprobs] == ids


def test_a_whole_request_ended_by_a_stop_token_names_it(tokenizer):
    ids = tokenizer.encode(TEXT)
    params = SamplingParams(max_tokens=99, stop_token_ids=[ids[-1]])
    [whole] = run(tokenizer, ids, params, whole=True, finish=FinishReason.STOP)
    assert whole.finish_reason == "stop" and whole.stop_reason == ids[-1]


def test_stop_strings_are_matched_as_the_tokens_come_even_when_read_whole(tokenizer):
    """Text can end such a request early, so it is decoded as it goes: the stop string ends it
    (and the engine is told to drop it) before the engine would have."""
    ids = tokenizer.encode(TEXT)
    params = SamplingParams(max_tokens=99, stop=["世界"])
    deltas = run(tokenizer, ids, params, whole=True)
    assert deltas[-1].finish_reason == "stop" and deltas[-1].stop_reason == "世界"
    assert deltas[-1].abort_in_engine
    assert joined(deltas).text == TEXT[: TEXT.index("世界")]
