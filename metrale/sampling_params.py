"""Every sampling knob a request carries, validated once at the edge.

The engine trusts a `SamplingParams` it is handed: each check lives in `__post_init__`, and each
error names the field and the allowed range, so a bad request is refused before it reaches the
scheduler and never disturbs the requests already running.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


@dataclass(frozen=True)
class ThinkingBudget:
    """At most `max_tokens` tokens inside thinking blocks; then `end_token_id` is forced.

    `starts_inside`: the prompt (the chat template) already opened the block, so the output
    begins inside it.
    """

    max_tokens: int
    start_token_id: int
    end_token_id: int
    starts_inside: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 0:
            _fail("thinking budget", self.max_tokens, "must be >= 0")


@dataclass(frozen=True)
class StructuredOutput:
    """A grammar the output must follow, enforced token by token (after any thinking block).

    `kind`: `json` (`spec` a JSON schema, or None for any JSON object), `regex` or `grammar`
    (EBNF). `max_leading_newlines`: newlines the output may start with, as thinking models
    write them between `</think>` and the answer (the reasoning parser drops them).
    """

    kind: str
    spec: str | None = None
    max_leading_newlines: int = 0

    KINDS = ("json", "regex", "grammar")

    def __post_init__(self) -> None:
        if self.kind not in self.KINDS:
            _fail("structured output kind", self.kind, f"must be one of {', '.join(self.KINDS)}")
        if self.kind != "json" and not self.spec:
            _fail("structured output", self.spec, f"a {self.kind} needs its text")


@dataclass(frozen=True)
class DryBreakers:
    """DRY's sequence breakers as token ids (resolved from strings by the frontend,
    `frontend/dry_breakers.py`): `single` tokens each end a repeat alone; each of `sequences`
    (a head token, then its tail) ends one when all of it is present."""

    single: tuple[int, ...] = ()
    sequences: tuple[tuple[int, ...], ...] = ()

    @property
    def empty(self) -> bool:
        return not self.single and not self.sequences


# llama.cpp's default breakers (common/common.h)
DEFAULT_DRY_BREAKERS = ("\n", ":", '"', "*")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    `temperature == 0` means greedy. `top_k == 0` and `top_p == 1` and `min_p == 0` disable those
    filters. Penalties follow OpenAI (presence, frequency: over the output so far) and
    Hugging Face (repetition: over prompt and output). `stop` strings are matched on the text
    by the frontend; the engine sees only token ids. `logprobs=N` returns the sampled token's
    log-probability plus the top N; the values are those of the model's raw distribution
    (before temperature and filters), as in vLLM. DRY (`dry_*`) and the LZ penalty
    (`lz_penalty`) follow llama.cpp and Ginart et al. (runner/repeat_penalties.py); DRY's
    breakers reach the engine as `dry_breakers`, token ids the frontend resolved from
    `dry_sequence_breakers` (unresolved, None, DRY runs without breakers).
    `kept_special_token_ids`: special tokens that stay in the text even with
    `skip_special_tokens` (a tool-call format's markers).
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    # llama.cpp's truncation samplers (runner/truncation.py); the defaults are off
    top_n_sigma: float = -1.0  # <= 0: off
    typical_p: float = 1.0
    xtc_threshold: float = 0.1
    xtc_probability: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # the penalties look at the last this many tokens of prompt and output only (llama.cpp's
    # penalty_last_n); 0: the whole sequence
    repetition_penalty_window: int = 0
    # DRY and the LZ penalty (runner/repeat_penalties.py): off while the multiplier and the
    # strength are 0. `dry_breakers` is None until the frontend resolves the strings.
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1  # -1: the whole sequence; 0: DRY off
    dry_sequence_breakers: tuple[str, ...] = DEFAULT_DRY_BREAKERS
    dry_breakers: DryBreakers | None = None
    lz_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    kept_special_token_ids: tuple[int, ...] = ()
    thinking: ThinkingBudget | None = None
    structured: StructuredOutput | None = None
    # the content-loop watchdog: end the output once one block of it repeats this many times
    # (engine/watchdog.py); 0: off
    content_loop_min_repeats: int = 0

    MAX_LOGPROBS = 20
    MAX_DRY_BREAKERS = 32
    MAX_LOOP_REPEATS = 1000

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "kept_special_token_ids", tuple(self.kept_special_token_ids))
        object.__setattr__(self, "dry_sequence_breakers", tuple(self.dry_sequence_breakers))
        object.__setattr__(
            self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        )
        self._check_integer_ranges()
        if self.n < 1:
            _fail("n", self.n, "must be >= 1")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            _fail("temperature", self.temperature, "must be a finite number >= 0 (0 = greedy)")
        if self.top_k < 0:
            _fail("top_k", self.top_k, "must be >= 0 (0 disables top-k)")
        if not (0.0 < self.top_p <= 1.0):
            _fail("top_p", self.top_p, "must be in (0, 1]")
        if not (0.0 <= self.min_p <= 1.0):
            _fail("min_p", self.min_p, "must be in [0, 1]")
        if not math.isfinite(self.top_n_sigma):
            _fail("top_n_sigma", self.top_n_sigma, "must be a finite number (<= 0 disables it)")
        if not (0.0 < self.typical_p <= 1.0):
            _fail("typical_p", self.typical_p, "must be in (0, 1] (1 disables it)")
        if not (0.0 <= self.xtc_threshold <= 1.0):
            _fail("xtc_threshold", self.xtc_threshold, "must be in [0, 1]")
        if not (0.0 <= self.xtc_probability <= 1.0):
            _fail("xtc_probability", self.xtc_probability, "must be in [0, 1] (0 disables XTC)")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (-2.0 <= value <= 2.0):
                _fail(name, value, "must be in [-2, 2]")
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0:
            _fail("repetition_penalty", self.repetition_penalty, "must be a finite number > 0")
        if self.repetition_penalty_window < 0:
            _fail(
                "repetition_penalty_window",
                self.repetition_penalty_window,
                "must be >= 0 (0: the whole sequence)",
            )
        self._check_repeat_penalties()
        for token_id, bias in (self.logit_bias or {}).items():
            if token_id < 0 or not (-100.0 <= bias <= 100.0):
                _fail(
                    "logit_bias",
                    {token_id: bias},
                    "keys must be token ids >= 0 and values in [-100, 100]",
                )
        if self.content_loop_min_repeats and not (
            2 <= self.content_loop_min_repeats <= self.MAX_LOOP_REPEATS
        ):
            _fail(
                "content_loop_min_repeats",
                self.content_loop_min_repeats,
                f"must be in [2, {self.MAX_LOOP_REPEATS}] (0 turns the watchdog off)",
            )
        if any(not s for s in self.stop):
            _fail("stop", list(self.stop), "stop strings must be non-empty")
        if self.max_tokens is not None and self.max_tokens < 1:
            _fail("max_tokens", self.max_tokens, "must be >= 1")
        if self.min_tokens < 0:
            _fail("min_tokens", self.min_tokens, "must be >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            _fail("min_tokens", self.min_tokens, f"must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and not (0 <= self.logprobs <= self.MAX_LOGPROBS):
            _fail("logprobs", self.logprobs, f"must be in [0, {self.MAX_LOGPROBS}]")
        if any(t < 0 for t in self.stop_token_ids):
            _fail("stop_token_ids", list(self.stop_token_ids), "token ids must be >= 0")

    def _check_integer_ranges(self) -> None:
        """Every integer knob fits the 64-bit integers the engine's tensors hold (a larger one
        would fail there, mid-step)."""
        for f in fields(self):
            value = getattr(self, f.name)
            values = value if isinstance(value, tuple) else (value,)
            for item in values:
                if isinstance(item, int) and not INT64_MIN <= item <= INT64_MAX:
                    _fail(f.name, value, "must fit in 64 bits")
        for token_id in self.logit_bias or {}:
            if not INT64_MIN <= token_id <= INT64_MAX:
                _fail("logit_bias", token_id, "keys must fit in 64 bits")

    def _check_repeat_penalties(self) -> None:
        if not math.isfinite(self.dry_multiplier) or self.dry_multiplier < 0:
            _fail("dry_multiplier", self.dry_multiplier, "must be a finite number >= 0 (0: off)")
        if not math.isfinite(self.dry_base) or self.dry_base < 1:
            _fail("dry_base", self.dry_base, "must be a finite number >= 1")
        if self.dry_allowed_length < 0:
            _fail("dry_allowed_length", self.dry_allowed_length, "must be >= 0")
        if self.dry_penalty_last_n < -1:
            _fail(
                "dry_penalty_last_n",
                self.dry_penalty_last_n,
                "must be >= -1 (-1: the whole sequence, 0: DRY off)",
            )
        breakers = self.dry_sequence_breakers
        if len(breakers) > self.MAX_DRY_BREAKERS or any(
            not isinstance(b, str) or not b for b in breakers
        ):
            _fail(
                "dry_sequence_breakers",
                list(breakers),
                f"must be at most {self.MAX_DRY_BREAKERS} non-empty strings",
            )
        if not math.isfinite(self.lz_penalty) or self.lz_penalty < 0:
            _fail("lz_penalty", self.lz_penalty, "must be a finite number >= 0 (0: off)")

    @functools.cached_property  # frozen: computed once
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @functools.cached_property  # frozen: computed once
    def truncates(self) -> bool:
        """Whether a llama.cpp truncation sampler is on (runner/truncation.py)."""
        return self.top_n_sigma > 0 or self.typical_p < 1.0 or self.xtc_probability > 0

    @functools.cached_property  # frozen: computed once
    def uses_dry(self) -> bool:
        return self.dry_multiplier > 0 and self.dry_penalty_last_n != 0

    @functools.cached_property  # frozen: computed once
    def reads_history(self) -> bool:
        """Whether a penalty reads the tokens so far (the counted ones, DRY, the LZ penalty):
        the runner keeps the request's history on the device (runner/repeat_history.py)."""
        return self.has_penalties or self.uses_dry or self.lz_penalty > 0

    @functools.cached_property  # frozen: computed once
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


def _fail(name: str, value: object, rule: str) -> None:
    raise ValueError(f"{name}={value!r} is out of range: {name} {rule}")
