"""A model driven through a few steps with no runner, on one rank or on each of several.

Two sequences share every step: a chunked prefill beside a whole one, then a chunk beside a
decode, then decodes; greedy tokens feed back (rank 0's, broadcast). Each step's logits at its
chunks' last rows are kept (on rank 0, where they are gathered), to compare a tensor-parallel
run with a single-process one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from metrale.config import CacheConfig, ModelConfig
from metrale.distributed.parallel_state import (
    destroy_tensor_parallel,
    init_tensor_parallel,
    tp_rank,
    tp_size,
)
from metrale.distributed.sharding import even_slice
from metrale.layers.attention import StepBatch
from metrale.layers.attention.torch_backend import TorchAttentionMetadata
from metrale.layers.linear import RowParallelLinear
from metrale.runner.kv_cache import PagedKVCache
from metrale.runner.model_loader import load_model

BLOCK_SIZE = 16
CPU = torch.device("cpu")
PROMPTS = ([(7 * i + 3) % 4000 for i in range(21)], [(11 * i + 5) % 4000 for i in range(7)])
# Each step's tokens per sequence: A prefills in two chunks while B prefills whole, then
# decodes.
SCHEDULE = ((12, 7), (9, 1), (1, 1), (1, 1), (1, 1), (1, 1))


@dataclass
class StepRecord:
    logits: list[torch.Tensor | None]  # per step: [num_chunks, vocab_size] (rank 0; else None)
    token_ids: list[list[int]]  # per sequence: prompt then greedy tokens
    num_parameters: int
    kv_shape: tuple[int, ...]


def run_steps(model_dir: Path, tensor_parallel_size: int) -> StepRecord:
    config = ModelConfig.from_dir(model_dir).with_tensor_parallel(tensor_parallel_size)
    model = load_model(model_dir, config, dtype=torch.float32, device=CPU, progress=False)
    cache = CacheConfig(
        block_size=BLOCK_SIZE, num_blocks=8, enable_prefix_caching=False, dtype=torch.float32
    )
    kv = PagedKVCache(model, config, cache, CPU)
    block_tables = torch.tensor([[0, 1, 2], [3, 4, 5]])
    token_ids = [list(p) for p in PROMPTS]
    num_computed = [0, 0]
    all_logits = []
    with torch.inference_mode():
        for step in SCHEDULE:
            # decodes first, as the scheduler orders them
            order = sorted(range(len(step)), key=lambda s: step[s] != 1)
            chunks = [(s, num_computed[s], step[s]) for s in order]
            logits = _forward(model, chunks, token_ids, block_tables, config)
            all_logits.append(logits)  # (None past rank 0: the logits are gathered there)
            # Rank 0 picks the tokens and tells the others, as the engine's step message does.
            picked = torch.zeros(len(chunks), dtype=torch.int64)
            if logits is not None:
                picked = logits.argmax(dim=-1)
            if tp_size() > 1:
                torch.distributed.broadcast(picked, src=0)
            for row, (s, start, n) in enumerate(chunks):
                num_computed[s] = start + n
                if num_computed[s] == len(token_ids[s]):
                    token_ids[s].append(int(picked[row]))
    num_parameters = sum(t.numel() for t in model.state_dict().values())
    return StepRecord(all_logits, token_ids, num_parameters, tuple(kv.kv.shape))


def _forward(model, chunks, token_ids, block_tables, config) -> torch.Tensor:
    input_ids, positions, slots, query_start_loc = [], [], [], [0]
    for s, start, n in chunks:
        pos = np.arange(start, start + n)
        input_ids += token_ids[s][start : start + n]
        positions += pos.tolist()
        slots += (
            block_tables[s, pos // BLOCK_SIZE].numpy() * BLOCK_SIZE + pos % BLOCK_SIZE
        ).tolist()
        query_start_loc.append(query_start_loc[-1] + n)
    seqs = [s for s, _, _ in chunks]
    starts = np.array([start for _, start, _ in chunks])
    batch = StepBatch(
        slot_mapping=torch.tensor(slots),
        block_tables=block_tables[seqs],
        seq_lens=torch.tensor([start + n for _, start, n in chunks]),
        query_start_loc=torch.tensor(query_start_loc),
        query_start_loc_host=np.array(query_start_loc),
        start_positions_host=starts,
        max_query_len=max(n for _, _, n in chunks),
        num_decode_seqs=sum(n == 1 for _, _, n in chunks),
        block_size=BLOCK_SIZE,
        sliding_window=config.sliding_window,
    )
    meta = TorchAttentionMetadata.build(batch)
    hidden = model(torch.tensor(input_ids), torch.tensor(positions), meta)
    last_rows = torch.tensor(query_start_loc[1:]) - 1
    return model.compute_logits(hidden[last_rows])


def row_parallel_bias_error() -> float:
    """How far a row-parallel layer with a bias (none of the test models has one) is from the
    whole layer: the bias must be added once, after the reduce."""
    torch.manual_seed(0)  # the same layer and input on every rank
    whole = torch.nn.Linear(32, 8)
    x = torch.randn(3, 32)
    part = even_slice("in_features", 32, tp_rank(), tp_size(), dim=1)
    layer = RowParallelLinear(part, 8, bias=True)
    with torch.no_grad():
        layer.weight.copy_(part.of(whole.weight))
        layer.bias.copy_(whole.bias)
        return float((layer(part.of(x)) - whole(x)).abs().max())


def worker(
    rank: int, world_size: int, port: int, model_dirs: dict[str, Path], out_dir: Path
) -> None:
    """One rank of a tensor-parallel run over every checkpoint; each saves its records in
    `out_dir`/rank<N>.pt."""
    torch.set_num_threads(1)  # two ranks on two cores
    init_tensor_parallel(world_size, rank, f"tcp://127.0.0.1:{port}", "gloo", timeout_s=60)
    try:
        records = {name: run_steps(path, world_size) for name, path in model_dirs.items()}
        records["row_parallel_bias_error"] = row_parallel_bias_error()
        torch.save(records, out_dir / f"rank{tp_rank()}.pt")
    finally:
        destroy_tensor_parallel()
