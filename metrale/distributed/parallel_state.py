"""This process's tensor-parallel group: its rank, the number of ranks, and the two collectives
the layers use.

Uninitialised, the group is one rank (rank 0, size 1) and both collectives return their input,
so single-process code pays nothing. Initialised, every rank holds a slice of each split layer
and runs the same forward; the collectives are torch.distributed's (NCCL on CUDA, gloo on CPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallelGroup:
    rank: int
    size: int
    backend: str


_group: TensorParallelGroup | None = None


def init_tensor_parallel(
    world_size: int,
    rank: int,
    init_method: str = "env://",
    backend: str | None = None,
    timeout_s: float = 600.0,
) -> TensorParallelGroup:
    """Join the group of `world_size` ranks as `rank`. `init_method`: env:// reads MASTER_ADDR
    and MASTER_PORT (as torchrun, Slurm and Kubernetes set them), or tcp://host:port.
    `backend`: nccl where CUDA is, else gloo. A collective that waits past `timeout_s` (a rank
    died) raises instead of hanging."""
    global _group
    if _group is not None:
        raise RuntimeError(
            f"the tensor-parallel group is already initialised (rank {_group.rank} of "
            f"{_group.size}): call destroy_tensor_parallel() first"
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is out of range for world_size={world_size}")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if world_size > 1:
        dist.init_process_group(
            backend,
            init_method=init_method,
            world_size=world_size,
            rank=rank,
            timeout=timedelta(seconds=timeout_s),
        )
    _group = TensorParallelGroup(rank, world_size, backend)
    return _group


def destroy_tensor_parallel() -> None:
    global _group
    if _group is not None and _group.size > 1:
        dist.destroy_process_group()
    _group = None


def tp_rank() -> int:
    return 0 if _group is None else _group.rank


def tp_size() -> int:
    return 1 if _group is None else _group.size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of every rank's `x`, in place."""
    if tp_size() == 1:
        return x
    dist.all_reduce(x)
    return x


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Every rank's `x` concatenated along `dim`, in rank order (each `x` of one shape)."""
    size = tp_size()
    if size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x)
    return torch.cat(parts, dim=dim)


def gather_to_first(x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
    """Every rank's `x` concatenated along `dim` on rank 0 (None on the others): what only
    rank 0 reads, as the logits it samples from, crosses the links once, not to every rank."""
    size = tp_size()
    if size == 1:
        return x
    x = x.contiguous()
    if tp_rank() != 0:
        dist.gather(x, dst=0)
        return None
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.gather(x, parts, dst=0)
    return torch.cat(parts, dim=dim)
