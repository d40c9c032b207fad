"""The prompts a benchmark sends: `random`, `sharegpt`, `prefix` and `sonnet`, all seeded.

Lengths are counted with the target's tokenizer (`--tokenizer`), without special tokens and
before any chat template, as `vllm bench serve` counts them. `random` and `prefix` prompts are
built token-exact: random token ids are decoded to text and re-encoded until the text is exactly
the length asked for (a byte-level BPE merges across the joins, so the first decode is usually
short); the rare prompt that cannot be made exact keeps the length it has, which is what its
`prompt_len` then says.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Protocol

DATASETS = ("random", "sharegpt", "prefix", "sonnet")
SONNET_BASE_PROMPT = "Pick as many lines as you can from these poem lines:\n"


class TextTokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def all_special_ids(self) -> tuple[int, ...]: ...


@dataclass(frozen=True)
class Sample:
    prompt: str
    prompt_len: int  # tokens, counted as the module docstring says
    output_len: int  # max_tokens asked for


@dataclass(frozen=True)
class DatasetSpec:
    name: str = "random"
    num_prompts: int = 100
    seed: int = 0
    input_len: int = 1024  # random, prefix (the suffix after the shared prefix), sonnet
    output_len: int = 128  # every dataset; sharegpt: None keeps each conversation's own reply
    range_ratio: float = 0.0  # random: lengths uniform in [len*(1-r), len*(1+r)]
    prefix_len: int = 0  # random: a prefix shared by all; prefix: per group; sonnet: fixed lines
    num_groups: int = 4  # prefix: how many distinct shared prefixes
    path: Path | None = None  # sharegpt: the local JSON file
    sharegpt_output_len: int | None = None  # sharegpt: fixed output length instead of the reply's


def sample_requests(spec: DatasetSpec, tokenizer: TextTokenizer) -> list[Sample]:
    """`spec.num_prompts` samples from the dataset it names; ValueError for a bad spec."""
    if spec.num_prompts < 1:
        raise ValueError("--num-prompts must be at least 1")
    if spec.output_len < 1:
        raise ValueError("the output length must be at least 1 token")
    rng = random.Random(spec.seed)
    if spec.name == "random":
        return _random(spec, tokenizer, rng)
    if spec.name == "prefix":
        return _prefix(spec, tokenizer, rng)
    if spec.name == "sharegpt":
        return _sharegpt(spec, tokenizer, rng)
    if spec.name == "sonnet":
        return _sonnet(spec, tokenizer, rng)
    raise ValueError(f"unknown dataset {spec.name!r}: use one of {', '.join(DATASETS)}")


def exact_prompt(
    tokenizer: TextTokenizer, token_ids: list[int], rng: random.Random
) -> tuple[str, int]:
    """Text that encodes to exactly `len(token_ids)` tokens, starting from those ids; and the
    length it reached (the target, but for a prompt that would not settle)."""
    target = len(token_ids)
    ordinary = _ordinary_ids(tokenizer)
    ids = list(token_ids)
    for _ in range(16):
        text = tokenizer.decode(ids, skip_special_tokens=True)
        encoded = tokenizer.encode(text, add_special_tokens=False)
        if len(encoded) == target:
            return text, target
        if len(encoded) > target:
            ids = encoded[:target]
        else:
            ids = encoded + [rng.choice(ordinary) for _ in range(target - len(encoded))]
    return text, len(encoded)


def _random(spec: DatasetSpec, tokenizer: TextTokenizer, rng: random.Random) -> list[Sample]:
    _check_lengths(spec.input_len, spec.range_ratio)
    ordinary = _ordinary_ids(tokenizer)
    prefix = [rng.choice(ordinary) for _ in range(spec.prefix_len)]
    samples = []
    for _ in range(spec.num_prompts):
        n_in = _ranged(spec.input_len, spec.range_ratio, rng)
        n_out = max(1, _ranged(spec.output_len, spec.range_ratio, rng))
        ids = prefix + [rng.choice(ordinary) for _ in range(n_in)]
        text, n = exact_prompt(tokenizer, ids, rng)
        samples.append(Sample(text, n, n_out))
    return samples


def _prefix(spec: DatasetSpec, tokenizer: TextTokenizer, rng: random.Random) -> list[Sample]:
    """`num_groups` shared prefixes of `prefix_len` tokens, each prompt one of them and a
    suffix of `input_len` tokens of its own; the groups interleave in a seeded order."""
    if spec.num_groups < 1 or spec.prefix_len < 1:
        raise ValueError("the prefix dataset needs --prefix-num-groups >= 1 and --prefix-len >= 1")
    ordinary = _ordinary_ids(tokenizer)
    prefixes = [
        exact_prompt(tokenizer, [rng.choice(ordinary) for _ in range(spec.prefix_len)], rng)[0]
        for _ in range(spec.num_groups)
    ]
    groups = [i % spec.num_groups for i in range(spec.num_prompts)]
    rng.shuffle(groups)
    samples = []
    for group in groups:
        suffix_ids = [rng.choice(ordinary) for _ in range(spec.input_len)]
        suffix, _ = exact_prompt(tokenizer, suffix_ids, rng)
        text = prefixes[group] + suffix
        samples.append(Sample(text, _count(tokenizer, text), spec.output_len))
    return samples


def _sharegpt(spec: DatasetSpec, tokenizer: TextTokenizer, rng: random.Random) -> list[Sample]:
    """The first human turn of each conversation as the prompt, the reply's length as the
    output length (or `sharegpt_output_len`); vLLM's filter: prompts and replies of 4 tokens or
    more, prompts of at most 1,024 tokens and pairs of at most 2,048."""
    if spec.path is None:
        raise ValueError("the sharegpt dataset reads a local file: pass --dataset-path FILE.json")
    try:
        entries = json.loads(Path(spec.path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"--dataset-path {spec.path}: not a readable JSON file ({e})") from None
    if not isinstance(entries, list):
        raise ValueError(f"--dataset-path {spec.path}: a ShareGPT file is a JSON list")
    pairs = [pair for entry in entries if (pair := _first_turns(entry)) is not None]
    rng.shuffle(pairs)
    samples = []
    for prompt, reply in pairs:
        n_in = _count(tokenizer, prompt)
        n_out = spec.sharegpt_output_len or _count(tokenizer, reply)
        fixed = spec.sharegpt_output_len is not None
        if n_in < 4 or (not fixed and n_out < 4) or n_in > 1024 or n_in + n_out > 2048:
            continue
        samples.append(Sample(prompt, n_in, n_out))
        if len(samples) == spec.num_prompts:
            return samples
    if not samples:
        raise ValueError(f"--dataset-path {spec.path}: no conversation passes the length filter")
    return samples  # fewer than asked: the file has no more


def _sonnet(spec: DatasetSpec, tokenizer: TextTokenizer, rng: random.Random) -> list[Sample]:
    """vLLM's sonnet recipe: a fixed instruction and the poem's first lines (about `prefix_len`
    tokens, shared by every prompt), then lines drawn at random until `input_len` tokens."""
    lines = [line for line in sonnet_lines() if line.strip()]
    base = SONNET_BASE_PROMPT
    fixed = base
    for line in lines:
        if _count(tokenizer, fixed + line) > spec.prefix_len:
            break
        fixed += line
    if _count(tokenizer, fixed) >= spec.input_len:
        raise ValueError(
            f"sonnet prompts of {spec.input_len} tokens cannot hold the {spec.prefix_len}-token "
            f"prefix: raise --input-len or lower --prefix-len"
        )
    samples = []
    for _ in range(spec.num_prompts):
        text = fixed
        while (n := _count(tokenizer, text)) < spec.input_len:
            text += rng.choice(lines)
        samples.append(Sample(text, n, spec.output_len))
    return samples


def sonnet_lines() -> list[str]:
    text = (resources.files(__package__) / "sonnets.txt").read_text()
    return text.splitlines(keepends=True)


def _first_turns(entry: object) -> tuple[str, str] | None:
    if not isinstance(entry, dict):
        return None
    turns = entry.get("conversations", entry.get("conversation"))
    if not isinstance(turns, list) or len(turns) < 2:
        return None
    texts = [t.get("value") if isinstance(t, dict) else None for t in turns[:2]]
    if not all(isinstance(t, str) for t in texts):
        return None
    return texts[0], texts[1]


def _ordinary_ids(tokenizer: TextTokenizer) -> list[int]:
    special = set(tokenizer.all_special_ids)
    return [i for i in range(tokenizer.vocab_size) if i not in special]


def _count(tokenizer: TextTokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def _ranged(length: int, ratio: float, rng: random.Random) -> int:
    low, high = round(length * (1 - ratio)), round(length * (1 + ratio))
    return rng.randint(low, high)


def _check_lengths(input_len: int, ratio: float) -> None:
    if input_len < 1:
        raise ValueError("--input-len must be at least 1")
    if not 0 <= ratio < 1:
        raise ValueError("--range-ratio must be in [0, 1)")
