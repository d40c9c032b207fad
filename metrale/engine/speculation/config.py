"""Speculative decoding's settings (`--speculative-config`), resolved once."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

METHODS = ("ngram",)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Prompt-lookup drafts of up to `num_speculative_tokens` tokens, proposed from the longest
    n-gram (`ngram_min <= n <= ngram_max`) that ends the request's tokens and occurred before."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    ngram_min: int = 2
    ngram_max: int = 5
    # A table across requests (shared_lookup.py), read when a request's own tokens have no match
    shared_lookup: bool = False
    shared_lookup_entries: int = 262_144
    # Draft only where it pays at the step's batch size, by costs measured at startup
    # (cost_model.py); off: every speculating request drafts at every batch size.
    cost_model: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"speculative method {self.method!r} is not known: use one of {', '.join(METHODS)}"
            )
        if not 1 <= self.num_speculative_tokens <= 32:
            raise ValueError(
                f"num_speculative_tokens={self.num_speculative_tokens} is out of range: "
                "must be in [1, 32]"
            )
        if self.shared_lookup_entries < 1:
            raise ValueError(
                f"shared_lookup_entries={self.shared_lookup_entries} is out of range: must be >= 1"
            )
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(
                f"ngram_min={self.ngram_min}, ngram_max={self.ngram_max}: need "
                "1 <= ngram_min <= ngram_max"
            )

    @classmethod
    def parse(
        cls,
        value: str | None,
        num_speculative_tokens: int | None = None,
        ngram_min: int | None = None,
        ngram_max: int | None = None,
        shared_lookup: bool = False,
        shared_lookup_entries: int | None = None,
        cost_model: bool | None = None,
    ) -> SpeculativeConfig | None:
        """`--speculative-config` as a method name or as vLLM's JSON object (`method`,
        `num_speculative_tokens`, `prompt_lookup_min`, `prompt_lookup_max`); the separate flags
        win over the JSON's fields. None: no speculation."""
        if value is None:
            flags = (num_speculative_tokens, ngram_min, ngram_max, shared_lookup_entries)
            if shared_lookup or any(v is not None for v in flags):
                raise ValueError(
                    "--num-speculative-tokens, --ngram-min, --ngram-max and --shared-lookup "
                    "need --speculative-config ngram"
                )
            return None
        fields: dict = {}
        if value.lstrip().startswith("{"):
            try:
                raw = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"--speculative-config is not valid JSON: {e}") from None
            names = {
                "method": "method",
                "num_speculative_tokens": "num_speculative_tokens",
                "prompt_lookup_min": "ngram_min",
                "prompt_lookup_max": "ngram_max",
            }
            unknown = sorted(set(raw) - set(names))
            if unknown:
                raise ValueError(
                    f"--speculative-config: unknown key {', '.join(unknown)} (known: "
                    f"{', '.join(names)})"
                )
            fields = {names[k]: v for k, v in raw.items()}
        else:
            fields["method"] = value
        overrides = {
            "num_speculative_tokens": num_speculative_tokens,
            "ngram_min": ngram_min,
            "ngram_max": ngram_max,
            "shared_lookup": shared_lookup or None,
            "shared_lookup_entries": shared_lookup_entries,
            "cost_model": cost_model,
        }
        fields |= {k: v for k, v in overrides.items() if v is not None}
        return cls(**fields)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        g = parser.add_argument_group("speculative decoding")
        g.add_argument(
            "--speculative-config",
            metavar="METHOD|JSON",
            help="ngram: draft tokens from the longest earlier match of the request's last "
            "tokens (prompt lookup), verified in one forward; greedy outputs are unchanged. Also "
            'vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": 4, '
            '"prompt_lookup_min": 2, "prompt_lookup_max": 5}',
        )
        g.add_argument(
            "--num-speculative-tokens",
            type=int,
            help="draft tokens per step at most (default 4)",
        )
        g.add_argument("--ngram-min", type=int, help="shortest n-gram matched (default 2)")
        g.add_argument("--ngram-max", type=int, help="longest n-gram matched (default 5)")
        g.add_argument(
            "--shared-lookup",
            action="store_true",
            help="also draft from a table of finished requests' text (what followed each "
            "--ngram-max-gram), kept apart per API key, when a request's own text has no match",
        )
        g.add_argument(
            "--shared-lookup-entries",
            type=int,
            help="n-grams the shared table holds at most, least recently used evicted first "
            "(default 262144, about 90 MB)",
        )
        g.add_argument(
            "--speculation-cost-model",
            action=argparse.BooleanOptionalAction,
            help="draft only where drafts pay at the step's batch size, by a verify step's cost "
            "measured at startup against a plain decode's (default on)",
        )
