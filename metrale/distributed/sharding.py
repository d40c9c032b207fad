"""How a checkpoint tensor splits across tensor-parallel ranks: which part each rank holds.

Query heads, the MLP's intermediate features and the vocabulary split evenly; KV heads split
evenly too, or, with fewer KV heads than ranks, each is replicated on the ranks whose query heads
read it. The vocabulary may be padded to a multiple of the ranks (the padding rows are never
looked up, and their logits are cut off); any other uneven split is a ValueError naming the sizes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class TensorSlice:
    """The part of a checkpoint tensor one rank holds: `length` entries from `start` along `dim`."""

    dim: int
    start: int
    length: int

    def index(self, ndim: int) -> tuple[slice, ...]:
        """The slice as an index, for a tensor (or a safetensors slice) of `ndim` dimensions."""
        whole = slice(None)
        return tuple(
            slice(self.start, self.start + self.length) if d == self.dim else whole
            for d in range(ndim)
        )

    def shape_of(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(self.length if d == self.dim else n for d, n in enumerate(shape))

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.narrow(self.dim, self.start, self.length)


def check_split(what: str, size: int, tp_size: int, *, replicable: bool = False) -> None:
    """Raise unless `size` splits evenly over `tp_size` ranks (or, `replicable`, each of fewer
    items than ranks serves a whole group of ranks)."""
    if size % tp_size == 0 or (replicable and size < tp_size and tp_size % size == 0):
        return
    fix = f"use a tensor-parallel size that divides {size}"
    if replicable:
        fix += f" or a multiple of {size}"
    raise ValueError(
        f"{what}={size} does not split over tensor_parallel_size={tp_size}: each rank must hold "
        f"a whole number of them; {fix}"
    )


def even_slice(what: str, size: int, rank: int, tp_size: int, dim: int = 0) -> TensorSlice:
    """Rank `rank`'s share of `size` entries along `dim`, split evenly."""
    check_split(what, size, tp_size)
    length = size // tp_size
    return TensorSlice(dim, rank * length, length)


def head_slice(
    what: str, num_heads: int, head_dim: int, rank: int, tp_size: int, *, replicable: bool
) -> TensorSlice:
    """The rows of a q, k or v projection that hold rank `rank`'s heads. KV heads
    (`replicable`) fewer than the ranks: the one head that this rank's query heads read."""
    check_split(what, num_heads, tp_size, replicable=replicable)
    num_local = max(1, num_heads // tp_size)
    first = rank * num_heads // tp_size
    return TensorSlice(0, first * head_dim, num_local * head_dim)


def vocab_slice(vocab_size: int, rank: int, tp_size: int) -> tuple[TensorSlice, int]:
    """Rank `rank`'s rows of the embedding or head (fewer on the last ranks when the vocabulary
    does not split evenly), and the rows each rank allocates, the vocabulary padded up to a
    multiple of `tp_size`."""
    rows_per_rank = -(-vocab_size // tp_size)
    start = min(rank * rows_per_rank, vocab_size)
    return TensorSlice(0, start, min(rows_per_rank, vocab_size - start)), rows_per_rank
