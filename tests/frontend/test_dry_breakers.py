"""DRY's breaker strings resolved to token ids as llama.cpp's `get_overlapping_token_sequences`
does, checked against its loop transliterated here over the whole demo vocabulary."""

from __future__ import annotations

import msgspec
import pytest

from metrale.engine.messages import EngineRequest
from metrale.frontend.dry_breakers import resolve_dry_breakers
from metrale.sampling_params import DEFAULT_DRY_BREAKERS, DryBreakers, SamplingParams
from metrale.tokenizer import Tokenizer
from tests.conftest import demo_tokenizer_dir


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(demo_tokenizer_dir())


def llama_cpp_breakers(tokenizer: Tokenizer, strings: tuple[str, ...]) -> DryBreakers:
    """llama.cpp's loop: every token containing the string, else each place where the token's
    text ends with the string's start, the rest of the string tokenized as the tail."""
    single, sequences = set(), set()
    for string in strings:
        string = string[:40]
        for token_id in range(tokenizer.vocab_size):
            word = tokenizer.decode([token_id], skip_special_tokens=False)
            if string in word:
                single.add(token_id)
                continue
            pos = word.find(string[0])
            while pos != -1:
                i = 1
                match = True
                while i < len(string) and i + pos < len(word):
                    if word[pos + i] != string[i]:
                        match = False
                        break
                    i += 1
                if match:
                    tail = tokenizer.encode(string[i:], add_special_tokens=False)[:20]
                    sequences.add((token_id, *tail))
                pos = word.find(string[0], pos + 1)
    return DryBreakers(tuple(sorted(single)), tuple(sorted(sequences)))


@pytest.mark.parametrize(
    "strings",
    [DEFAULT_DRY_BREAKERS, ("###", "\n\n", "User:"), ("ing the",), ("x" * 45,)],
)
def test_breakers_resolve_as_llama_cpp_resolves_them(tokenizer, strings):
    params = SamplingParams(dry_multiplier=0.5, dry_sequence_breakers=strings)
    resolved = resolve_dry_breakers(params, tokenizer).dry_breakers
    assert resolved == llama_cpp_breakers(tokenizer, strings)
    assert not resolved.empty  # each set above names tokens of the demo vocabulary


def test_multi_token_breakers_have_tails(tokenizer):
    resolved = resolve_dry_breakers(
        SamplingParams(dry_multiplier=0.5, dry_sequence_breakers=("###", "User:")), tokenizer
    ).dry_breakers
    assert resolved.sequences and all(len(s) >= 2 for s in resolved.sequences)


def test_resolution_is_cached_and_only_for_dry(tokenizer):
    params = SamplingParams(dry_multiplier=0.5)
    first = resolve_dry_breakers(params, tokenizer).dry_breakers
    assert resolve_dry_breakers(params, tokenizer).dry_breakers is first
    assert resolve_dry_breakers(SamplingParams(lz_penalty=1.0), tokenizer).dry_breakers is None


def test_resolved_breakers_cross_to_the_engine_process(tokenizer):
    params = resolve_dry_breakers(SamplingParams(dry_multiplier=0.5), tokenizer)
    wire = msgspec.msgpack.encode(EngineRequest("r", [1, 2], params, 0.0))
    decoded = msgspec.msgpack.decode(wire, type=EngineRequest)
    assert decoded.sampling_params == params


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"dry_multiplier": -1.0}, "dry_multiplier"),
        ({"dry_base": 0.9}, "dry_base"),
        ({"dry_allowed_length": -1}, "dry_allowed_length"),
        ({"dry_penalty_last_n": -2}, "dry_penalty_last_n"),
        ({"dry_sequence_breakers": ("",)}, "dry_sequence_breakers"),
        ({"dry_sequence_breakers": ("a",) * 33}, "dry_sequence_breakers"),
        ({"lz_penalty": float("nan")}, "lz_penalty"),
        ({"lz_penalty": -0.1}, "lz_penalty"),
        # integers past 64 bits would fail in the engine's tensors, mid-step
        ({"dry_allowed_length": 2**64}, "dry_allowed_length"),
        ({"top_k": 10**20}, "top_k"),
        ({"repetition_penalty_window": 2**70}, "repetition_penalty_window"),
        ({"stop_token_ids": (2**64,)}, "stop_token_ids"),
    ],
)
def test_bad_values_are_refused_naming_the_field(fields, problem):
    with pytest.raises(ValueError, match=problem):
        SamplingParams(**fields)
