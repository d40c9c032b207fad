"""What rank 0 tells the other tensor-parallel ranks each step: one int64 message, broadcast.

Rank 0 schedules and samples; the other ranks only run their slices of the model over the same
flat batch. So the message is the batch itself, laid out once by rank 0's runner: the input ids
(after the pending tokens of async scheduling are filled in, on rank 0's device), positions,
cache slots, block tables, sequence lengths and query starts, the rows whose logits the step
needs, and the KV block copies to and from the host pool that come before it. It is a fixed
header, then a body of the lengths the header gives, each broadcast by torch.distributed from
rank 0 (a device tensor under NCCL, so the broadcast stays in stream order and async scheduling
never waits for it; a host tensor under gloo). No Python object is pickled per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from metrale.layers.attention import StepBatch
from metrale.runner.input_buffers import to_device

STOP, STEP = 0, 1
# kind, num_tokens, num_seqs, max_blocks, max_query_len, num_decode_seqs, num_samples,
# num_swap_out, num_swap_in
HEADER_LEN = 9


@dataclass
class StepInputs:
    """One step, as a rank other than 0 runs it."""

    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    batch: StepBatch | None  # None: the step only copies blocks
    logits_indices: torch.Tensor  # [num_samples] rows whose logits the step computes
    swap_out: list[tuple[int, int]]  # (device, host) block copies, before the step
    swap_in: list[tuple[int, int]]  # (host, device)


def send_step(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    batch: StepBatch | None,
    logits_indices: torch.Tensor,
    swap_out: list[tuple[int, int]],
    swap_in: list[tuple[int, int]],
) -> None:
    """Rank 0: broadcast the step it is about to run (tensors on its device)."""
    device = input_ids.device
    num_tokens = input_ids.shape[0]
    if batch is None:
        header = [STEP, 0, 0, 0, 0, 0, 0, len(swap_out), len(swap_in)]
        parts = []
    else:
        num_seqs, max_blocks = batch.block_tables.shape
        header = [
            STEP,
            num_tokens,
            num_seqs,
            max_blocks,
            batch.max_query_len,
            batch.num_decode_seqs,
            logits_indices.shape[0],
            len(swap_out),
            len(swap_in),
        ]
        host = np.concatenate([batch.query_start_loc_host, batch.start_positions_host])
        parts = [
            input_ids,
            positions,
            batch.slot_mapping,
            batch.block_tables.reshape(-1),
            batch.seq_lens,
            to_device(host, torch.int64, device),
            logits_indices,
        ]
    swaps = np.asarray([*swap_out, *swap_in], dtype=np.int64).reshape(-1)
    parts.append(to_device(swaps, torch.int64, device))
    # (staged through pinned memory: a copy from pageable memory would wait for the stream)
    _broadcast(to_device(header, torch.int64, device))
    _broadcast(torch.cat([p.to(torch.int64) for p in parts]))


def send_stop(device: torch.device) -> None:
    """Rank 0: tell the other ranks to leave their loops."""
    _broadcast(torch.tensor([STOP] + [0] * (HEADER_LEN - 1), dtype=torch.int64, device=device))


def receive_step(
    device: torch.device, block_size: int, sliding_window: int | None
) -> StepInputs | None:
    """A rank other than 0: wait for the next step (None: stop)."""
    header = torch.empty(HEADER_LEN, dtype=torch.int64, device=device)
    _broadcast(header)
    kind, num_tokens, num_seqs, max_blocks, max_query_len, num_decode_seqs, num_samples = header[
        :7
    ].tolist()
    num_swap_out, num_swap_in = header[7:].tolist()
    if kind == STOP:
        return None
    lengths = [
        num_tokens,  # input ids
        num_tokens,  # positions
        num_tokens,  # slots
        num_seqs * max_blocks,
        num_seqs,  # seq lens
        (num_seqs + 1 if num_tokens else 0) + num_seqs,  # query starts, start positions (host)
        num_samples,
        2 * (num_swap_out + num_swap_in),
    ]
    body = torch.empty(sum(lengths), dtype=torch.int64, device=device)
    _broadcast(body)
    ids, positions, slots, tables, seq_lens, host, logits_indices, swaps = body.split(lengths)
    pairs = [tuple(p) for p in swaps.view(-1, 2).tolist()]
    swap_out, swap_in = pairs[:num_swap_out], pairs[num_swap_out:]
    if num_tokens == 0:
        return StepInputs(ids, positions, None, logits_indices, swap_out, swap_in)
    host = host.cpu().numpy()
    batch = StepBatch(
        slot_mapping=slots,
        block_tables=tables.view(num_seqs, max_blocks),
        seq_lens=seq_lens,
        query_start_loc=torch.as_tensor(host[: num_seqs + 1]).to(device),
        query_start_loc_host=host[: num_seqs + 1],
        start_positions_host=host[num_seqs + 1 :],
        max_query_len=max_query_len,
        num_decode_seqs=num_decode_seqs,
        block_size=block_size,
        sliding_window=sliding_window,
    )
    return StepInputs(ids, positions, batch, logits_indices, swap_out, swap_in)


def _broadcast(tensor: torch.Tensor) -> None:
    dist.broadcast(tensor, src=0)
