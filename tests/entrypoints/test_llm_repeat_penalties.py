"""The penalties (counted, DRY, LZ) end to end: our engine's greedy tokens are those of
transformers' logits reshaped by the plain references (`tests/runner/reference_repeats.py`) one
step at a time, batched beside a request that uses none, under sync and async scheduling; and a
preemption storm (recompute or swap) changes no token."""

from __future__ import annotations

import pytest
import torch

from metrale import LLM, SamplingParams
from metrale.frontend.dry_breakers import resolve_dry_breakers
from tests.conftest import build_checkpoint
from tests.entrypoints.test_llm_matches_transformers import prompts_of
from tests.fidelity import NEAR_TIE
from tests.runner.reference_repeats import ref_penalised

MAX_NEW_TOKENS = 20
BASE = {"temperature": 0.0, "max_tokens": MAX_NEW_TOKENS, "ignore_eos": True}
PARAMS = [
    SamplingParams(**BASE, dry_multiplier=0.8),
    SamplingParams(**BASE, lz_penalty=0.5),
    SamplingParams(**BASE),
    SamplingParams(
        **BASE,
        dry_multiplier=2.0,
        dry_base=1.5,
        dry_allowed_length=1,
        dry_penalty_last_n=24,
        dry_sequence_breakers=(".", ","),
        lz_penalty=0.3,
    ),
    SamplingParams(
        **BASE,
        presence_penalty=0.6,
        frequency_penalty=0.4,
        repetition_penalty=1.3,
        repetition_penalty_window=16,
    ),
]


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    model_dir = build_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3")
    loop = prompts_of([6], seed=3)[0]
    prompts = [loop * 5, prompts_of([30], seed=4)[0], loop * 3, loop * 4 + prompts_of([9])[0]]
    prompts.append(loop * 2)
    return model_dir, prompts


def reference_tokens(model, prompt: list[int], params: SamplingParams) -> list[tuple[int, float]]:
    """Each step's argmax of the penalised logits, and its lead over the runner-up."""
    ids = list(prompt)
    steps = []
    for _ in range(MAX_NEW_TOKENS):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].double().tolist()
        logits = ref_penalised(logits, ids, len(prompt), params)
        top2 = torch.tensor(logits).topk(2)
        steps.append((int(top2.indices[0]), float(top2.values[0] - top2.values[1])))
        ids.append(steps[-1][0])
    return steps


def assert_reference(ours: list[int], reference: list[tuple[int, float]], what: str) -> None:
    """Equal tokens up to the first difference, which may only fall on a near tie."""
    for step, (token, (ref_token, lead)) in enumerate(zip(ours, reference, strict=True)):
        if token != ref_token:
            assert lead < NEAR_TIE, f"{what}: step {step}: {token} != {ref_token}"
            return


@pytest.mark.parametrize("scheduling", ["sync", "async"])
def test_greedy_tokens_follow_transformers_with_the_references(case, scheduling):
    import transformers

    model_dir, prompts = case
    llm = LLM(model_from_path=str(model_dir), dtype="float32", scheduler_config=scheduling)
    outputs = llm.generate(prompts, PARAMS, use_tqdm=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    changed = 0
    for i, (prompt, params, out) in enumerate(zip(prompts, PARAMS, outputs, strict=True)):
        resolved = resolve_dry_breakers(params, llm.tokenizer)
        ours = out.outputs[0].token_ids
        assert_reference(ours, reference_tokens(model.eval(), prompt, resolved), f"request {i}")
        plain = reference_tokens(model, prompt, SamplingParams(**BASE))
        changed += ours != [token for token, _ in plain]
    assert changed >= 3  # the penalties changed what the looping prompts make the model say


@pytest.mark.parametrize("preemption_mode", ["swap", "recompute"])
def test_a_preemption_storm_changes_nothing(case, preemption_mode):
    model_dir, prompts = case

    def generate(**pool):
        llm = LLM(model_from_path=str(model_dir), dtype="float32", scheduler_config="async", **pool)
        outputs = llm.generate(prompts, PARAMS, use_tqdm=False)
        # The runner hears of finished requests at its next step: every slot is free after it.
        llm.generate([prompts[0]], SamplingParams(max_tokens=2), use_tqdm=False)
        assert not llm.engine.runner.sampling.repeat_history.slots
        return [o.outputs[0].token_ids for o in outputs], llm.engine.scheduler

    alone, _ = generate()
    stormed, scheduler = generate(
        num_kv_blocks=8, swap_space_gb=0.01, preemption_mode=preemption_mode
    )
    assert scheduler.num_preemptions > 0
    assert stormed == alone
