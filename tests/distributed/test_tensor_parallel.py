"""Tensor parallelism on 2 CPU ranks (gloo): the sharded forward gives the single-process
model's logits (to 1e-4 in fp32, on rank 0, where they are gathered) and greedy tokens, over
chunked prefill, a mixed step and decodes, for KV heads split evenly and replicated, biased
q/k/v, a tied head and a vocabulary that does not split evenly; each rank holds about half the
weights and its own KV heads."""

from __future__ import annotations

import dataclasses
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from metrale.checkpoint.weights import iter_checkpoint_tensors, preflight
from metrale.config import ModelConfig
from metrale.distributed.parallel_state import all_gather, all_reduce, tp_rank, tp_size
from metrale.distributed.sharding import TensorSlice, vocab_slice
from metrale.models import model_class_for
from metrale.runner.model_loader import load_model
from tests.conftest import build_checkpoint
from tests.distributed.steps import StepRecord, run_steps, worker

WORLD_SIZE = 2
CPU = torch.device("cpu")
# name -> (architecture, config overrides)
CHECKPOINTS = {
    # 4 query heads, 1 KV head: each rank keeps the one KV head (replicated)
    "llama_kv_replicated": ("llama", {"num_key_value_heads": 1}),
    # 4 query heads, 2 KV heads: one each; q/k norms
    "qwen3_kv_split": ("qwen3", {}),
    # q/k/v biases, split with their rows
    "qwen2_bias": ("qwen2", {}),
    # the head is the embedding; 4,097 rows: ranks hold 2,049 and 2,048 (+1 padding)
    "llama_tied_odd_vocab": ("llama", {"tie_word_embeddings": True, "vocab_size": 4097}),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        name: build_checkpoint(tmp_path_factory.mktemp(name), arch, **overrides)
        for name, (arch, overrides) in CHECKPOINTS.items()
    }


@pytest.fixture(scope="module")
def tp_records(
    model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> list[dict[str, StepRecord]]:
    """Each rank's records of one 2-rank run over every checkpoint."""
    out_dir = tmp_path_factory.mktemp("tp")
    mp.spawn(worker, args=(WORLD_SIZE, _free_port(), model_dirs, out_dir), nprocs=WORLD_SIZE)
    return [
        torch.load(out_dir / f"rank{rank}.pt", weights_only=False) for rank in range(WORLD_SIZE)
    ]


@pytest.fixture(scope="module")
def single_records(model_dirs: dict[str, Path]) -> dict[str, StepRecord]:
    return {name: run_steps(path, tensor_parallel_size=1) for name, path in model_dirs.items()}


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_two_ranks_give_the_single_process_logits_and_tokens(name, single_records, tp_records):
    single = single_records[name]
    for rank, records in enumerate(tp_records):
        split = records[name]
        assert split.token_ids == single.token_ids, f"rank {rank}"
        assert len(split.logits) == len(single.logits)
        if rank > 0:  # the logits are gathered on rank 0 alone
            assert all(logits is None for logits in split.logits)
            continue
        for step, (ours, theirs) in enumerate(zip(split.logits, single.logits, strict=True)):
            assert ours.shape == theirs.shape  # the gathered vocabulary, padding cut off
            torch.testing.assert_close(
                ours, theirs, rtol=0, atol=1e-4, msg=f"rank {rank}, step {step}"
            )


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_each_rank_holds_its_share(name, model_dirs, single_records, tp_records):
    single = single_records[name]
    config = ModelConfig.from_dir(model_dirs[name])
    for records in tp_records:
        split = records[name]
        # [layers, 2, blocks, block_size, kv heads, head_dim]: one KV head per rank
        assert split.kv_shape[4] == 1
        assert split.kv_shape[4] == max(1, config.num_kv_heads // WORLD_SIZE)
        assert split.kv_shape[:4] + split.kv_shape[5:] == single.kv_shape[:4] + single.kv_shape[5:]
        # norms are replicated, and so are KV heads fewer than the ranks
        assert split.num_parameters < 0.56 * single.num_parameters


def test_a_row_parallel_bias_is_added_once(tp_records) -> None:
    for records in tp_records:
        assert records["row_parallel_bias_error"] < 1e-5


def test_a_rank_reads_only_its_slice_of_each_tensor(model_dirs) -> None:
    model_dir = model_dirs["qwen3_kv_split"]
    config = ModelConfig.from_dir(model_dir)
    expected = model_class_for(config.architecture).checkpoint_shapes(config)
    checked = preflight(model_dir, expected)
    whole = dict(iter_checkpoint_tensors(checked, CPU, progress=False))
    rows = TensorSlice(0, 16, 16)
    columns = TensorSlice(1, 32, 32)
    parts = {"model.embed_tokens.weight": rows, "model.layers.0.mlp.down_proj.weight": columns}
    sliced = dict(iter_checkpoint_tensors(checked, CPU, progress=False, slice_of=parts.get))
    assert sliced.keys() == whole.keys()
    for name, tensor in whole.items():
        part = parts.get(name)
        torch.testing.assert_close(sliced[name], tensor if part is None else part.of(tensor))
    assert sliced["model.layers.0.mlp.down_proj.weight"].shape == (64, 32)


def test_one_process_is_a_group_of_one() -> None:
    assert (tp_rank(), tp_size()) == (0, 1)
    x = torch.randn(3, 5)
    assert all_reduce(x) is x
    assert all_gather(x, dim=-1) is x


def test_uneven_splits_name_the_sizes(tmp_path) -> None:
    config = ModelConfig.from_dir(build_checkpoint(tmp_path, "llama"))  # 4 heads, 2 KV heads
    with pytest.raises(ValueError, match=r"num_attention_heads=4 .* tensor_parallel_size=3"):
        config.with_tensor_parallel(3)
    assert config.with_tensor_parallel(4).num_kv_heads_per_rank == 1  # replicated, 2 ranks each
    with pytest.raises(ValueError, match=r"intermediate_size=150 .* tensor_parallel_size=4"):
        dataclasses.replace(config, intermediate_size=150).with_tensor_parallel(4)
    raw = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 64,
        "hidden_size": 96,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 6,
        "num_key_value_heads": 3,
    }
    with pytest.raises(ValueError, match=r"num_key_value_heads=3 .* tensor_parallel_size=2"):
        ModelConfig.from_hf(raw).with_tensor_parallel(2)


def test_a_split_config_needs_a_group_of_its_size(tmp_path) -> None:
    model_dir = build_checkpoint(tmp_path, "llama")
    config = ModelConfig.from_dir(model_dir).with_tensor_parallel(2)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 .* has 1"):
        load_model(model_dir, config, dtype=torch.float32, device=CPU)


def test_the_vocabulary_pads_to_a_multiple_of_the_ranks() -> None:
    assert vocab_slice(4097, 0, 2) == (TensorSlice(0, 0, 2049), 2049)
    assert vocab_slice(4097, 1, 2) == (TensorSlice(0, 2049, 2048), 2049)
    assert vocab_slice(4096, 1, 2) == (TensorSlice(0, 2048, 2048), 2048)
