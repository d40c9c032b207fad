"""Attention over the paged KV cache.

The runner describes each step once (`StepBatch`), and the chosen backend turns it into its
own metadata, which the model hands down to every layer as an argument. The metadata knows how
to attend (`meta.attend(layer, q, k, v, rope)`): each layer rotates q and k to their positions,
writes the step's keys and values into their cache slots, then attends over the cache, so
prefix-cache hits, chunked prefill and decode are one code path. The rotation is the backend's
so that the `triton` one can rotate k straight into the cache, in the launch that stores it.

Backends: `torch` (scaled_dot_product_attention over gathered blocks; runs anywhere, the
reference) and `triton` (paged kernels; GPUs).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch import nn

from metrale.config import is_fp8


@dataclass(frozen=True)
class StepBatch:
    """The flat batch of one step, as every attention backend needs it."""

    slot_mapping: torch.Tensor  # [num_tokens] cache slot of each token; < 0: padding, skip
    block_tables: torch.Tensor  # [num_seqs, max_blocks] padded with block 0
    seq_lens: torch.Tensor  # [num_seqs] tokens in the cache once this step is stored
    query_start_loc: torch.Tensor  # [num_seqs + 1] each sequence's first row in the batch
    query_start_loc_host: np.ndarray  # the same, on the host
    start_positions_host: np.ndarray  # [num_seqs] computed tokens before the step
    max_query_len: int
    # The leading sequences of one query row each (the scheduler puts decodes first): a
    # backend may run them with a decode kernel, apart from the longer chunks after them.
    num_decode_seqs: int
    block_size: int
    sliding_window: int | None


class Rotary(Protocol):
    """Rotates q and k to the step's positions (`metrale.layers.rotary`)."""

    def rotate_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


class AttentionMetadata(Protocol):
    def attend(
        self, layer: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: Rotary
    ) -> torch.Tensor: ...


class Attention(nn.Module):
    """Multi-head attention with grouped KV heads over one layer's slice of the KV pool."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.cache_index = 0  # its layer's index in the pool, `[num_layers, 2, ...]`

    def bind_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor, index: int = 0) -> None:
        # each: [num_blocks, block_size, num_kv_heads, head_dim]
        self.k_cache, self.v_cache = k_cache, v_cache
        self.cache_index = index

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        rope: Rotary,
    ) -> torch.Tensor:
        """q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]; q
        and k not yet rotated. Returns [num_tokens, num_heads, head_dim]."""
        return meta.attend(self, q, k, v, rope)


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Keys or values as a cache of `dtype` stores them. fp8 saturates at its largest finite
    value: a plain cast turns an outlier into nan (e4m3) or inf (e5m2), which would poison
    every later attention over that key."""
    if is_fp8(dtype):
        limit = torch.finfo(dtype).max
        x = x.clamp(-limit, limit)
    return x.to(dtype)


MetadataBuilder = Callable[[StepBatch], AttentionMetadata]


def metadata_builder(backend: str) -> MetadataBuilder:
    """The metadata constructor of a backend, chosen once at startup."""
    if backend == "torch":
        from metrale.layers.attention.torch_backend import TorchAttentionMetadata

        return TorchAttentionMetadata.build
    if backend == "triton":
        from metrale.layers.attention.triton_backend import TritonAttentionMetadata

        return TritonAttentionMetadata.build
    raise ValueError(f"attention_backend={backend!r}: use torch, triton or auto")


def resolve_backend(name: str, device: torch.device) -> str:
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    # Triton's interpreter (TRITON_INTERPRET=1) runs the kernels on the host, slowly: the tests
    # use it to run the GPU code path end to end on CPU.
    if name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "attention_backend=triton needs a CUDA device: use --attention-backend torch on CPU"
        )
    return name
