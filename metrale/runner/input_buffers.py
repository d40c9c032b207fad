"""Persistent input buffers for the flat batch of a step.

Allocated once at the largest step size, so the per-step work is filling numpy views of host
memory and one non-blocking copy per tensor: no allocation in the hot path, and fixed device
addresses that a captured CUDA graph can read. On CPU the host buffer is the device buffer.

The host side is pinned memory that the copies read after the host has moved on: the runner
waits for a step's copies to be done before it fills the buffers for the next one.
"""

from __future__ import annotations

import numpy as np
import torch

from metrale.runner.random_draws import NUM_DRAWS

ROW_PARAMS = ("temperature", "top_k", "top_p", "min_p")  # the sampling parameters of each row


def to_device(values: np.ndarray | list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A step's small, variable-sized host values on the device without waiting for it: staged
    in pinned memory on a GPU (a copy from pageable memory first waits for the stream to drain,
    which would stall async scheduling). PyTorch's pinned-memory cache keeps the staging block
    until the copy has read it."""
    host = torch.as_tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


class InputBuffer:
    """A host/device pair of 1-D or 2-D buffers of one dtype."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        on_cuda = device.type == "cuda"
        self.host = torch.zeros(shape, dtype=dtype, pin_memory=on_cuda)
        self.device = torch.zeros(shape, dtype=dtype, device=device) if on_cuda else self.host
        self.np: np.ndarray = self.host.numpy()

    def copy_to_device(self, n: int) -> torch.Tensor:
        """The first `n` rows, on the device."""
        if self.device is self.host:
            return self.host[:n]
        return self.device[:n].copy_(self.host[:n], non_blocking=True)


class InputBuffers:
    def __init__(
        self,
        max_num_tokens: int,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        device: torch.device,
    ) -> None:
        self.input_ids = InputBuffer((max_num_tokens,), torch.int64, device)
        self.positions = InputBuffer((max_num_tokens,), torch.int64, device)
        self.slot_mapping = InputBuffer((max_num_tokens,), torch.int64, device)
        self.start_positions = InputBuffer((max_num_seqs,), torch.int64, device)
        self.seq_lens = InputBuffer((max_num_seqs,), torch.int64, device)
        self.query_start_loc = InputBuffer((max_num_seqs + 1,), torch.int64, device)
        self.block_tables = InputBuffer((max_num_seqs, max_blocks_per_seq), torch.int64, device)
        # One row per sampled position: a sequence's, or each position of a chunk with drafts.
        self.logits_indices = InputBuffer((max_num_tokens,), torch.int64, device)
        # Where a pending token goes in `input_ids`, and its row in the previous step's samples.
        self.pending_dst = InputBuffer((max_num_seqs,), torch.int64, device)
        self.pending_src = InputBuffer((max_num_seqs,), torch.int64, device)
        # The sampling parameters of each row.
        # Columns `ROW_PARAMS` (top_k as a float: exact below 2**24), so one copy moves them.
        self.row_params = InputBuffer((max_num_tokens, len(ROW_PARAMS)), torch.float32, device)
        self.draws = InputBuffer((max_num_tokens, NUM_DRAWS), torch.float64, device)
