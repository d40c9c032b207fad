"""The sampler's inputs from step to step: what the rows' parameters alone give is kept for a
step with the same rows, and what follows the rows' positions or parameters never is."""

from __future__ import annotations

import numpy as np
import torch

from metrale.engine.step import ScheduledChunk
from metrale.runner.input_buffers import InputBuffers
from metrale.runner.random_draws import TOKEN, seeded_draws
from metrale.runner.sampler import SamplingMetadata
from metrale.runner.sampling_inputs import SamplingInputs
from metrale.sampling_params import SamplingParams

VOCAB = 64


def inputs() -> SamplingInputs:
    cpu = torch.device("cpu")
    return SamplingInputs(InputBuffers(64, 8, 4, cpu), VOCAB, 128, cpu)


def decode(request_id: str, position: int, params: SamplingParams) -> ScheduledChunk:
    return ScheduledChunk(request_id, [5], position, [0], True, params)


def row_values(meta: SamplingMetadata) -> list[tuple[float, ...]]:
    random = meta.random
    assert random is not None
    columns = (random.temperature, random.top_k, random.top_p, random.min_p)
    return [tuple(round(c[i].item(), 4) for c in columns) for i in range(len(random.temperature))]


def test_a_step_with_the_same_rows_draws_at_its_own_positions():
    a = SamplingParams(temperature=0.7, top_p=0.9, seed=3)
    b = SamplingParams(temperature=1.2, top_k=5, logit_bias={4: 2.0}, seed=9)
    sampling = inputs()
    for step in range(3):
        meta = sampling.metadata([decode("a", 10 + step, a), decode("b", 30 + step, b)])
        assert row_values(meta) == [(0.7, VOCAB, 0.9, 0.0), (1.2, 5, 1.0, 0.0)]
        expected = seeded_draws([3, 9], [11 + step, 31 + step])  # the token after the chunk's
        assert np.array_equal(meta.random.draws.numpy(), expected)
        assert meta.logit_bias is not None and meta.logit_bias.rows.tolist() == [1]


def test_a_step_whose_rows_change_gets_their_parameters():
    a = SamplingParams(temperature=0.7, seed=3)
    b = SamplingParams(temperature=1.2, top_k=5, logit_bias={4: 2.0})
    c = SamplingParams(temperature=0.5, min_p=0.1, seed=4)
    sampling = inputs()
    sampling.metadata([decode("a", 10, a), decode("b", 20, b)])

    swapped = sampling.metadata([decode("b", 21, b), decode("a", 11, a)])
    assert row_values(swapped) == [(1.2, 5, 1.0, 0.0), (0.7, VOCAB, 1.0, 0.0)]
    assert swapped.logit_bias.rows.tolist() == [0]
    assert swapped.random.draws[1, TOKEN].item() == seeded_draws([3], [12])[0, TOKEN]

    replaced = sampling.metadata([decode("b", 22, b), decode("c", 40, c)])
    assert row_values(replaced) == [(1.2, 5, 1.0, 0.0), (0.5, VOCAB, 1.0, 0.1)]
    assert replaced.random.any_min_p and not swapped.random.any_min_p

    fewer = sampling.metadata([decode("c", 41, c)])
    assert row_values(fewer) == [(0.5, VOCAB, 1.0, 0.1)] and fewer.logit_bias is None

    greedy = SamplingParams(temperature=0.0, logprobs=2)
    assert sampling.metadata([decode("g", 5, greedy)]).random is None
    assert sampling.metadata([decode("g", 6, greedy)]).max_num_logprobs == 2
