"""DRY's sequence breakers, from strings to the token ids the engine matches.

As llama.cpp resolves them (`get_overlapping_token_sequences` in `src/llama-sampling.cpp`, after
koboldcpp): each breaker string (cut to 40 characters) makes every token whose text contains it
a single-token breaker, and every token whose text ends with a proper prefix of it the head of a
sequence whose tail is the rest of the string, tokenized (at most 20 tokens). Token texts are
each token decoded alone. A tokenizer's texts and each breaker set are resolved once and cached.
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache
from weakref import WeakKeyDictionary

from metrale.sampling_params import DryBreakers, SamplingParams
from metrale.tokenizer import Tokenizer

MAX_BREAKER_CHARS = 40
MAX_TAIL_TOKENS = 20


class _Vocabulary:
    """Each token's text, and the tokens grouped by the last character of their text."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.texts = tokenizer.decode_each(range(tokenizer.vocab_size))
        self.by_last_char: dict[str, list[int]] = {}
        for token_id, text in enumerate(self.texts):
            if text:
                self.by_last_char.setdefault(text[-1], []).append(token_id)

    @lru_cache(maxsize=64)  # noqa: B019 (one vocabulary per tokenizer, kept while it lives)
    def breakers(self, strings: tuple[str, ...]) -> DryBreakers:
        single: set[int] = set()
        sequences: set[tuple[int, ...]] = set()
        for string in strings:
            string = string[:MAX_BREAKER_CHARS]
            single.update(i for i, text in enumerate(self.texts) if string in text)
            for cut in range(1, len(string)):  # a text ending with string[:cut]
                prefix = string[:cut]
                heads = [
                    i
                    for i in self.by_last_char.get(prefix[-1], ())
                    if self.texts[i].endswith(prefix) and string not in self.texts[i]
                ]
                if heads:
                    tail = self.tokenizer.encode(string[cut:], add_special_tokens=False)
                    tail = tail[:MAX_TAIL_TOKENS]
                    sequences.update((head, *tail) for head in heads)
        return DryBreakers(tuple(sorted(single)), tuple(sorted(sequences)))


_vocabularies: WeakKeyDictionary[Tokenizer, _Vocabulary] = WeakKeyDictionary()


def resolve_dry_breakers(params: SamplingParams, tokenizer: Tokenizer) -> SamplingParams:
    """`params` with its breaker strings resolved to token ids, when it uses DRY."""
    if params.dry_multiplier <= 0 or params.dry_breakers is not None:
        return params
    vocabulary = _vocabularies.get(tokenizer)
    if vocabulary is None:
        vocabulary = _vocabularies[tokenizer] = _Vocabulary(tokenizer)
    breakers = vocabulary.breakers(params.dry_sequence_breakers)
    return dataclasses.replace(params, dry_breakers=breakers)
