"""The rule every test comparing our engine's greedy tokens with a reference follows.

Tokens must be equal. The only excuse for a difference is a near tie in the reference: where its
two most likely tokens' logprobs are closer than the comparison's tolerance, a change of
summation order may flip the choice, and from there on the two sequences run on different
prefixes, so the comparison of that sequence stops. Logprobs are compared for the same token
only.

A reference is anything with `token_ids`, `top2_gap(step)` and `logprob_of(step, token)`:
transformers' `generate` (`hf_greedy`, the whole log-softmax at each step) or a completion of
our own engine (`EngineReference`, which must have asked for `logprobs` >= 2 to see its top two).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from metrale.outputs import CompletionOutput

NEAR_TIE = 1e-4  # a top-2 logit gap this small may flip with any change of summation order


class GreedyReference(Protocol):
    @property
    def token_ids(self) -> list[int]: ...

    def top2_gap(self, step: int) -> float: ...

    def logprob_of(self, step: int, token: int) -> float | None: ...


@dataclass(frozen=True)
class Reference:
    token_ids: list[int]
    logprobs: list[torch.Tensor]  # [vocab] log-softmax at each generated position

    def top2_gap(self, step: int) -> float:
        top2 = self.logprobs[step].topk(2).values
        return float(top2[0] - top2[1])

    def logprob_of(self, step: int, token: int) -> float | None:
        return float(self.logprobs[step][token])


@dataclass(frozen=True)
class EngineReference:
    """A completion of our engine taken as the reference (the CPU path, say)."""

    completion: CompletionOutput

    @property
    def token_ids(self) -> list[int]:
        return self.completion.token_ids

    def top2_gap(self, step: int) -> float:
        position = self.completion.logprobs[step]
        top = sorted((lp.logprob for lp in position.values()), reverse=True)
        assert len(top) >= 2, "the reference must ask for logprobs >= 2 to see its top two"
        return top[0] - top[1]

    def logprob_of(self, step: int, token: int) -> float | None:
        """None where the token is neither the reference's choice nor in its top N."""
        lp = self.completion.logprobs[step].get(token)
        return None if lp is None else lp.logprob


def hf_greedy(
    model_dir: Path,
    prompts: list[list[int]],
    max_new_tokens: int = 24,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
    device: str = "cpu",
    gguf_file: str | None = None,
    model: object | None = None,
) -> list[Reference]:
    """transformers' own greedy `generate`, one prompt at a time (no padding); `gguf_file`: a
    GGUF file in `model_dir`, which transformers dequantizes; `model`: one already loaded."""
    import transformers

    extra = {"gguf_file": gguf_file} if gguf_file else {}
    model = model or (
        transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=dtype, attn_implementation=attn_implementation, **extra
        )
        .to(device)
        .eval()
    )
    model.generation_config.eos_token_id = None
    refs = []
    for prompt in prompts:
        out = model.generate(
            torch.tensor([prompt], device=device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
        refs.append(
            Reference(
                out.sequences[0, len(prompt) :].tolist(),
                [torch.log_softmax(step[0].float(), dim=-1).cpu() for step in out.logits],
            )
        )
    return refs


def assert_greedy_match(
    ours: list[int], ref: GreedyReference, what: str, near_tie: float = NEAR_TIE
) -> int:
    """Tokens must be equal up to the first difference, which must fall on a near tie of the
    reference (named on stdout, so it is visible). Returns the steps that match, the ones whose
    logprobs may be compared."""
    for step, (a, b) in enumerate(zip(ours, ref.token_ids, strict=True)):
        if a != b:
            gap = ref.top2_gap(step)
            assert gap < near_tie, (
                f"{what}: token {step} is {a}, the reference gives {b} "
                f"(its top-2 gap {gap:.3g} is no tie under {near_tie:g})"
            )
            print(f"{what}: near tie at step {step} (gap {gap:.2e}); compared up to it")
            return step
    return len(ours)


@dataclass(frozen=True)
class Agreement:
    matched: int  # steps whose tokens match the reference's
    worst_logprob_error: float  # over every logprob compared
    tie_gap: float | None  # the reference's top-two gap where the tokens part, if they do

    def __str__(self) -> str:
        tie = "" if self.tie_gap is None else f", parts on a tie of gap {self.tie_gap:.3g}"
        return f"{self.matched} tokens match, logprobs within {self.worst_logprob_error:.3g}{tie}"


def assert_close_to_reference(
    completion: CompletionOutput, ref: GreedyReference, what: str, tolerance: float
) -> Agreement:
    """`assert_greedy_match` with `tolerance` as the near tie, then every logprob our engine
    returned (its token and its top N) against the reference's logprob of the same token, up to
    and including the step of a divergence (both still saw the same prefix there)."""
    matched = assert_greedy_match(completion.token_ids, ref, what, near_tie=tolerance)
    worst = 0.0
    for step in range(min(matched + 1, len(completion.token_ids))):
        for token, ours in completion.logprobs[step].items():
            theirs = ref.logprob_of(step, token)
            if theirs is None:
                continue
            assert abs(ours.logprob - theirs) < tolerance, (
                f"{what}: step {step}, token {token}: logprob {ours.logprob:.5f}, "
                f"the reference's {theirs:.5f} (tolerance {tolerance:g})"
            )
            worst = max(worst, abs(ours.logprob - theirs))
    tie_gap = ref.top2_gap(matched) if matched < len(completion.token_ids) else None
    return Agreement(matched, worst, tie_gap)
