"""The last layer past its attention works on the rows that sample only (`rows` of the model's
forward, which the runner passes as the step's logits rows): a prompt chunk's other rows only
had to store their keys and values. Every row's keys and values are still stored, the rows kept
give the hidden states of the full forward, and the engine's greedy tokens and logprobs still
match transformers with prompts chunked so that some steps sample nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from metrale import LLM, SamplingParams
from tests.entrypoints.test_llm_matches_transformers import check, prompts_of
from tests.fidelity import hf_greedy

NEW_TOKENS = 4


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model_dir(request, tmp_path_factory):
    from tests.conftest import build_checkpoint

    return build_checkpoint(tmp_path_factory.mktemp(request.param), request.param)


@contextlib.contextmanager
def rows_seen(llm: LLM) -> Iterator[tuple[list[int], list[int]]]:
    """The row count of each call of the first layer's MLP and of the last layer's."""
    layers = llm.engine.runner.model.model.layers
    first, last = [], []
    hooks = [
        layer.mlp.register_forward_hook(
            lambda _m, args, _out, calls=calls: calls.append(len(args[0]))
        )
        for layer, calls in ((layers[0], first), (layers[-1], last))
    ]
    try:
        yield first, last
    finally:
        for hook in hooks:
            hook.remove()


def test_chunks_that_sample_nothing_skip_the_last_layers_mlp(model_dir):
    prompt = prompts_of([40])
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5)
    llm = LLM(
        model_from_path=str(model_dir),
        dtype="float32",
        enforce_eager=True,
        max_num_batched_tokens=16,
        max_num_seqs=4,
        enable_prefix_caching=False,
    )
    with rows_seen(llm) as (first, last):
        outputs = llm.generate(prompt, params, use_tqdm=False)
    # 40 prompt tokens in chunks of 16, 16 and 8 (only the last samples), then a row a step.
    assert first == [16, 16, 8] + [1] * (NEW_TOKENS - 1)
    assert last == [1] * NEW_TOKENS
    check(outputs, hf_greedy(model_dir, prompt, NEW_TOKENS), "chunked")


def test_batched_prompts_keep_one_row_each_and_match_transformers(model_dir):
    prompts = prompts_of((5, 17, 40, 33, 1), seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5)
    llm = LLM(model_from_path=str(model_dir), dtype="float32", enforce_eager=True)
    with rows_seen(llm) as (first, last):
        outputs = llm.generate(prompts, params, use_tqdm=False)
    assert first[0] == sum(map(len, prompts)) and last[0] == len(prompts)
    assert first[1:] == last[1:] == [len(prompts)] * (NEW_TOKENS - 1)
    check(outputs, hf_greedy(model_dir, prompts, NEW_TOKENS), "batched")


def test_the_kept_rows_equal_the_full_forward_and_every_row_is_stored(model_dir):
    """One step of two prompts through the model's forward: all rows, then each prompt's last
    row, then none, each over a zeroed pool: the kept rows' hidden states are the full
    forward's, and the pool holds the same after each."""
    llm = LLM(model_from_path=str(model_dir), dtype="float32", enforce_eager=True)
    runner = llm.engine.runner
    forward, pool = runner.model.forward, runner.kv_cache.kv
    seen = []

    def spy(input_ids, positions, meta, rows=None):
        n = len(input_ids)
        for kept in (None, torch.tensor([8, n - 1]), torch.tensor([], dtype=torch.long)):
            pool.zero_()
            hidden = forward(input_ids, positions, meta, kept)
            seen.append((kept, hidden, pool.clone()))
        return forward(input_ids, positions, meta, rows)

    runner.model.forward = spy
    llm.generate(prompts_of((9, 14), seed=5), SamplingParams(max_tokens=1), use_tqdm=False)
    (_, full, full_pool), *kept_runs = seen
    assert full.shape[0] == 23 and full_pool.count_nonzero() > 0
    for kept, hidden, kept_pool in kept_runs:
        assert hidden.shape == (len(kept), full.shape[1])
        torch.testing.assert_close(hidden, full[kept], rtol=1e-5, atol=1e-5)
        assert torch.equal(kept_pool, full_pool)
