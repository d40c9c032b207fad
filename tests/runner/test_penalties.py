"""Penalties and logit bias against a plain reference written here, one token at a time."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from torch import nn

from metrale.config import CacheConfig, ModelConfig, SchedulerConfig
from metrale.engine.block_pool import BlockPool
from metrale.engine.kv_cache_manager import KVCacheManager
from metrale.engine.request import Request
from metrale.engine.scheduler import Scheduler
from metrale.engine.step import ModelRunnerOutput, ScheduledChunk, TokenHistory
from metrale.runner.model_runner import ModelRunner
from metrale.runner.sampler import SamplingMetadata, _adjust_logits, sample
from metrale.sampling_params import SamplingParams, StructuredOutput

VOCAB = 50


def reference(
    row_logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]
) -> torch.Tensor:
    """One row adjusted as vLLM does: bias, then repetition, frequency and presence."""
    logits = row_logits.double().tolist()
    for token_id, value in (params.logit_bias or {}).items():
        logits[token_id] += value
    for token_id in set(prompt) | set(output):
        if logits[token_id] > 0:
            logits[token_id] /= params.repetition_penalty
        else:
            logits[token_id] *= params.repetition_penalty
    for token_id in set(output):
        logits[token_id] -= params.frequency_penalty * output.count(token_id)
        logits[token_id] -= params.presence_penalty
    return torch.tensor(logits, dtype=torch.float32)


def make_meta(
    params: list[SamplingParams], histories: list[tuple[list[int], list[int]] | None]
) -> SamplingMetadata:
    """Metadata for a batch as the runner builds it: a row with penalties has its history."""
    chunks = [
        chunk(row, p, TokenHistory(*histories[row]) if p.reads_history else None)
        for row, p in enumerate(params)
    ]
    return make_runner().sampling.metadata(chunks)


def random_history(rng: random.Random) -> tuple[list[int], list[int]]:
    """Ids drawn from a few tokens, so tokens repeat within and across prompt and output."""
    pool = rng.sample(range(VOCAB), 12)
    prompt = [rng.choice(pool) for _ in range(rng.randint(1, 20))]
    output = [rng.choice(pool) for _ in range(rng.randint(0, 15))]
    return prompt, output


PENALTY_CASES = {
    "presence": dict(presence_penalty=1.5),
    "negative_presence": dict(presence_penalty=-0.7),
    "frequency": dict(frequency_penalty=0.8),
    "negative_frequency": dict(frequency_penalty=-2.0),
    "repetition": dict(repetition_penalty=1.3),
    "repetition_below_one": dict(repetition_penalty=0.6),
    "bias": dict(logit_bias={3: 5.0, 17: -4.5, 49: 0.25}),
    "combined": dict(
        presence_penalty=0.5,
        frequency_penalty=-0.4,
        repetition_penalty=1.7,
        logit_bias={0: 2.0, 7: -1.0},
    ),
}


# --- adjusted logits against the reference ------------------------------------------------------


@pytest.mark.parametrize("case", PENALTY_CASES)
def test_each_penalty_matches_the_reference(case: str):
    rng = random.Random(case)
    torch.manual_seed(len(case))
    num_rows = 6
    params = [SamplingParams(temperature=0, **PENALTY_CASES[case]) for _ in range(num_rows)]
    histories = [random_history(rng) for _ in range(num_rows)]
    histories[0] = (histories[0][0], [])  # the first step: nothing generated yet
    logits = torch.randn(num_rows, VOCAB) * 3
    adjusted = logits.clone()
    _adjust_logits(adjusted, make_meta(params, histories))
    for row, (prompt, output) in enumerate(histories):
        expected = reference(logits[row], params[row], prompt, output)
        torch.testing.assert_close(adjusted[row], expected, rtol=1e-6, atol=1e-5)
    assert not torch.equal(adjusted, logits), "the case changes something"


def test_mixed_batch_leaves_rows_without_penalties_bit_identical():
    rng = random.Random(0)
    torch.manual_seed(0)
    cases = list(PENALTY_CASES.values())
    params = [
        SamplingParams(temperature=0.8, **cases[row // 2]) if row % 2 else SamplingParams()
        for row in range(2 * len(cases))
    ]
    histories = [random_history(rng) for _ in params]
    logits = torch.randn(len(params), VOCAB) * 3
    adjusted = logits.clone()
    _adjust_logits(adjusted, make_meta(params, histories))
    for row, (prompt, output) in enumerate(histories):
        if row % 2:
            expected = reference(logits[row], params[row], prompt, output)
            torch.testing.assert_close(adjusted[row], expected, rtol=1e-6, atol=1e-5)
        else:
            assert torch.equal(adjusted[row], logits[row])


def test_mixed_batch_samples_plain_rows_as_if_alone():
    # Seeded rows, with and without penalties elsewhere in the batch: the plain rows draw the
    # same tokens, and the penalised greedy rows take the reference's argmax.
    rng = random.Random(1)
    torch.manual_seed(1)
    num_rows = 8
    plain = [SamplingParams(temperature=t, seed=i) for i, t in enumerate((1.0, 0.0, 0.7, 1.3) * 2)]
    penalised = list(plain)
    for row in (1, 3, 5):
        penalised[row] = replace(plain[row], frequency_penalty=2.0, repetition_penalty=1.5)
    histories = [random_history(rng) for _ in range(num_rows)]
    logits = torch.randn(num_rows, VOCAB) * 2
    alone = sample(logits.clone(), make_meta(plain, histories)).token_ids
    mixed = sample(logits.clone(), make_meta(penalised, histories)).token_ids
    for row in (0, 2, 4, 6, 7):
        assert mixed[row] == alone[row]
    prompt, output = histories[1]
    assert mixed[1] == reference(logits[1], penalised[1], prompt, output).argmax()


def test_frequency_penalty_changes_the_greedy_pick():
    logits = torch.zeros(1, VOCAB)
    logits[0, 4] = 3.0
    logits[0, 9] = 2.0
    meta = make_meta([SamplingParams(temperature=0, frequency_penalty=0.6)], [([], [4, 4])])
    assert sample(logits.clone(), meta).token_ids.tolist() == [9], "3 - 2 * 0.6 < 2"
    meta = make_meta([SamplingParams(temperature=0, frequency_penalty=0.4)], [([], [4, 4])])
    assert sample(logits.clone(), meta).token_ids.tolist() == [4], "3 - 2 * 0.4 > 2"


# --- logit bias under greedy ---------------------------------------------------------------------


def test_logit_bias_forces_and_forbids_tokens_under_greedy():
    torch.manual_seed(2)
    logits = torch.randn(4, VOCAB) * 3
    argmax = logits.argmax(dim=-1)
    second = logits.topk(2, dim=-1).indices[:, 1]
    params = [
        SamplingParams(temperature=0, logit_bias={11: 100.0}),
        SamplingParams(temperature=0, logit_bias={argmax[1].item(): -100.0}),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, logit_bias={argmax[3].item(): -100.0, 30: 100.0}),
    ]
    meta = make_meta(params, [None] * 4)
    assert meta.all_greedy and meta.penalties is None
    out = sample(logits.clone(), meta).token_ids
    assert out.tolist() == [11, second[1].item(), argmax[2].item(), 30]


# --- host side: the scheduler hands histories, the runner packs them ----------------------------


class NoLayers(nn.Module):
    def attention_layers(self) -> list[nn.Module]:
        return []


def make_runner() -> ModelRunner:
    """A runner with no model: enough to build sampling metadata on the CPU."""
    config = ModelConfig.from_hf(
        dict(
            architectures=["Qwen3ForCausalLM"],
            vocab_size=VOCAB,
            hidden_size=8,
            intermediate_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
        )
    )
    scheduler = SchedulerConfig(
        max_num_seqs=16,
        max_batch_size=16,
        max_prefill_tokens=64,
        max_num_batched_tokens=64,
        max_seq_len=64,
    )
    cache = CacheConfig(
        block_size=4, num_blocks=16, enable_prefix_caching=False, dtype=torch.float32
    )
    return ModelRunner(NoLayers(), config, cache, scheduler, torch.device("cpu"))


def chunk(row: int, params: SamplingParams, history: TokenHistory | None) -> ScheduledChunk:
    return ScheduledChunk(f"r{row}", [1], 0, [0], True, params, token_history=history)


def test_runner_keeps_histories_the_sampler_applies():
    rng = random.Random(3)
    torch.manual_seed(3)
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, presence_penalty=1.0, logit_bias={5: 3.0}),
        SamplingParams(temperature=0, repetition_penalty=1.4, frequency_penalty=0.3),
        SamplingParams(temperature=0, logit_bias={2: -1.0, 8: 2.5}),
        SamplingParams(temperature=0, frequency_penalty=-1.0),
    ]
    histories = [TokenHistory(*random_history(rng)) for _ in params]
    histories[4] = TokenHistory(histories[4].prompt_token_ids, [])
    chunks = [
        chunk(row, p, histories[row] if p.has_penalties else None) for row, p in enumerate(params)
    ]
    meta = make_runner().sampling.metadata(chunks)
    assert meta.penalties is not None and meta.penalties.rows.tolist() == [1, 2, 4]
    logits = torch.randn(len(params), VOCAB) * 3
    adjusted = logits.clone()
    _adjust_logits(adjusted, meta)
    for row, (prompt, output) in enumerate(histories):
        expected = reference(logits[row], params[row], prompt, output)
        torch.testing.assert_close(adjusted[row], expected, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("window", [1, 3, 7, 12, 1000])
def test_a_penalty_window_counts_only_the_last_tokens(window):
    """repetition_penalty_window N: the penalties see the last N tokens of prompt + output, as
    llama.cpp's penalty_last_n: the reference on that tail (its output part counting for
    frequency and presence)."""
    prompt, output = [1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 3, 10, 11]
    params = SamplingParams(
        temperature=0,
        repetition_penalty=1.5,
        frequency_penalty=0.5,
        presence_penalty=0.3,
        repetition_penalty_window=window,
    )
    meta = make_runner().sampling.metadata([chunk(0, params, TokenHistory(prompt, output))])
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(window)) * 3
    adjusted = logits.clone()
    _adjust_logits(adjusted, meta)
    tail_output = output[-window:]
    tail_prompt = prompt[len(prompt) - (window - len(tail_output)) :] if window > 5 else []
    expected = reference(logits[0], params, tail_prompt, tail_output)
    torch.testing.assert_close(adjusted[0], expected, rtol=1e-6, atol=1e-5)
    if window < len(prompt + output):
        whole = reference(logits[0], params, prompt, output)
        assert not torch.allclose(adjusted[0], whole)
    with pytest.raises(ValueError, match="repetition_penalty_window"):
        SamplingParams(repetition_penalty_window=-1)


def test_runner_metadata_has_no_penalty_or_bias_pass_when_no_row_asks():
    chunks = [chunk(row, SamplingParams(temperature=0), None) for row in range(3)]
    meta = make_runner().sampling.metadata(chunks)
    assert meta.penalties is None and meta.logit_bias is None and meta.all_greedy


def small_scheduler(max_prefill_tokens: int) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=4,
        max_batch_size=4,
        max_prefill_tokens=max_prefill_tokens,
        max_num_batched_tokens=max(16, max_prefill_tokens),
        max_seq_len=64,
    )
    return Scheduler(config, KVCacheManager(BlockPool(32, enable_prefix_caching=False), 4))


def test_scheduler_shares_histories_only_with_sampling_chunks_that_have_penalties():
    scheduler = small_scheduler(max_prefill_tokens=8)
    penalised = Request("pen", list(range(12)), SamplingParams(frequency_penalty=1.0))
    plain = Request("plain", list(range(3)), SamplingParams(logit_bias={1: 1.0}))
    scheduler.add_request(penalised)
    scheduler.add_request(plain)
    first = scheduler.schedule()
    (prefill,) = first.chunks  # the prefill budget is spent on the first 8 prompt tokens
    assert not prefill.samples and prefill.token_history is None
    scheduler.update(first, ModelRunnerOutput([], []))
    second = {c.request_id: c for c in scheduler.schedule().chunks}
    assert second["plain"].samples and second["plain"].token_history is None
    assert second["pen"].samples
    history = second["pen"].token_history
    assert history is not None
    assert history.prompt_token_ids is penalised.prompt_token_ids
    assert history.output_token_ids is penalised.output_token_ids, "shared, not copied"


def test_penalised_requests_get_histories_but_never_make_async_steps_wait():
    """Every penalty reads the history the device keeps, so a request with one goes on while
    its last token is pending; a grammar, decided on the host, makes the step wait."""
    scheduler = small_scheduler(max_prefill_tokens=64)
    for i, params in enumerate(
        [
            SamplingParams(dry_multiplier=0.8, lz_penalty=0.1),
            SamplingParams(presence_penalty=1.0, repetition_penalty=1.2),
        ]
    ):
        scheduler.add_request(Request(f"pen{i}", [1, 2, 3], params))
    step = scheduler.schedule()
    assert all(c.token_history is not None for c in step.chunks)
    assert not scheduler.needs_pending_tokens()  # their tokens are pending: no wait
    scheduler.add_request(
        Request("json", [4, 5], SamplingParams(structured=StructuredOutput("json")))
    )
    scheduler.schedule()
    assert scheduler.needs_pending_tokens()
