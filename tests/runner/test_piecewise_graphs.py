"""The parts of `runner/piecewise_graphs.py` that run anywhere: which token counts are captured
and the non-owning views its attention calls hold. The graphs themselves are tested on a GPU
(tests/gpu/test_engine_on_gpu.py: piecewise against eager, and against the CPU reference)."""

from __future__ import annotations

import pytest
import torch

from metrale.engine_args import EngineArgs
from metrale.runner.cuda_graphs import padded_size
from metrale.runner.piecewise_graphs import alias, graph_token_counts


@pytest.mark.parametrize(
    ("max_tokens", "counts"),
    [
        (0, []),
        (48, [48]),
        (64, [64]),
        (328, [64, 128, 256, 328]),
        (1024, [64, 128, 256, 512, 1024]),
        (4352, [64, 128, 256, 512, 1024, 1536, 2048, 3072, 4096, 4352]),
        (8448, [64, 128, 256, 512, 1024, 1536, *range(2048, 8193, 1024), 8448]),
    ],
)
def test_graph_token_counts(max_tokens, counts):
    assert graph_token_counts(max_tokens) == counts


def test_padding_past_1024_tokens_costs_at_most_a_third():
    counts = graph_token_counts(8448)
    for n in range(1025, 8449):
        padded = next(c for c in counts if c >= n)
        assert (padded - n) / padded < 1 / 3


def test_a_step_takes_the_smallest_captured_size_that_holds_it():
    sizes = graph_token_counts(328)
    assert [padded_size(sizes, n) for n in (1, 64, 65, 300, 328, 329)] == [
        64, 64, 128, 328, 328, None,
    ]  # fmt: skip


def test_an_alias_reads_and_writes_the_memory_of_a_strided_view():
    base = torch.arange(24, dtype=torch.float32).view(4, 6)
    view = base[:, 2:5]  # strided, offset
    a = alias(view)
    assert a.shape == view.shape and a.stride() == view.stride()
    assert a.data_ptr() == view.data_ptr() and torch.equal(a, view)
    a[1, 0] = -1.0
    assert base[1, 2] == -1.0


def test_prompt_step_graphs_are_off_on_a_cpu_whatever_is_asked(qwen3_dir):
    args = EngineArgs(model_from_path=str(qwen3_dir), device="cpu", max_cuda_graph_tokens=512)
    config = args.create_config()
    assert config.max_cuda_graph_tokens == 0 and config.max_cuda_graph_batch == 0
