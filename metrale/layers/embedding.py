"""Token embeddings with the vocabulary split across tensor-parallel ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from metrale.distributed.parallel_state import all_reduce, tp_rank, tp_size
from metrale.distributed.sharding import TensorSlice, vocab_slice


class VocabParallelEmbedding(nn.Module):
    """Each rank holds a slice of the vocabulary's rows (padded to a multiple of the ranks, as
    `ParallelLMHead` pads it, so a tied head shares the parameter). A rank looks up the ids in
    its slice and gives zeros for the rest; the all-reduce sums the one nonzero row per token.
    With one rank it is `nn.Embedding`: `weight` [vocab_size, hidden_size]."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.vocab_slice, rows_per_rank = vocab_slice(vocab_size, tp_rank(), tp_size())
        self.split = tp_size() > 1
        self.weight = nn.Parameter(torch.empty(rows_per_rank, hidden_size))
        nn.init.normal_(self.weight)  # as nn.Embedding's; loading overwrites it

    def checkpoint_slice(self, kind: str, shard: int) -> TensorSlice | None:
        return self.vocab_slice if self.split else None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [num_tokens] -> [num_tokens, hidden_size]
        if not self.split:
            return F.embedding(input_ids, self.weight)
        local_ids = input_ids - self.vocab_slice.start
        elsewhere = (local_ids < 0) | (local_ids >= self.vocab_slice.length)
        x = F.embedding(local_ids.masked_fill(elsewhere, 0), self.weight)
        return all_reduce(x.masked_fill_(elsewhere.unsqueeze(-1), 0.0))

    def extra_repr(self) -> str:
        return f"{self.vocab_slice.start}..{self.vocab_slice.start + self.vocab_slice.length}"
