"""The ways a stream can cut one text into deltas, for differential tests of parsers.

A parser is correct only if every cut gives the same result: the whole text at once, one
character at a time, the demo tokenizer's tokens decoded one by one (as the server streams
them), and seeded random bursts of several tokens or characters.
"""

from __future__ import annotations

import functools
import random
import zlib
from collections.abc import Iterator, Sequence
from importlib import resources

from tokenizers import Tokenizer

REPLACEMENT_CHAR = "\ufffd"


@functools.cache
def demo_tokenizer() -> Tokenizer:
    return Tokenizer.from_file(
        str(resources.files("metrale.demo") / "tokenizer" / "tokenizer.json")
    )


def token_deltas(text: str, burst_sizes: Iterator[int] | None = None) -> list[str]:
    """Text deltas as streaming detokenization yields them: a delta ends where the decoded
    prefix is complete (a multi-byte character split across tokens waits for its last byte)."""
    tokenizer = demo_tokenizer()
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert tokenizer.decode(ids, skip_special_tokens=False) == text, "fixture must round-trip"
    deltas: list[str] = []
    num_emitted = end = 0
    while end < len(ids):
        end = min(len(ids), end + (next(burst_sizes) if burst_sizes is not None else 1))
        decoded = tokenizer.decode(ids[:end], skip_special_tokens=False)
        if end < len(ids):
            decoded = decoded.rstrip(REPLACEMENT_CHAR)
        deltas.append(decoded[num_emitted:])
        num_emitted = len(decoded)
    assert "".join(deltas) == text
    return deltas


def char_bursts(text: str, rng: random.Random, max_chars: int = 12) -> list[str]:
    deltas, at = [], 0
    while at < len(text):
        size = rng.randint(1, max_chars)
        deltas.append(text[at : at + size])
        at += size
    return deltas


def splittings(text: str, seed_name: str) -> dict[str, Sequence[str]]:
    rng = random.Random(zlib.crc32(seed_name.encode()))
    bursts = iter(lambda: rng.randint(1, 6), None)
    return {
        "whole": [text],
        "per_char": list(text),
        "per_token": token_deltas(text),
        "token_bursts": token_deltas(text, bursts),
        "char_bursts": char_bursts(text, rng),
    }
