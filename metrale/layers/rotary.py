"""Rotary position embeddings (the "rotate half" / NeoX layout), with Llama-3 and linear scaling."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import nn

from metrale.config import RopeConfig
from metrale.kernels import cpu_extension
from metrale.layers.layernorm import RMSNorm

# Qwen3's RMSNorm over each query and key head, applied before the rotation: (q norm, k norm).
HeadNorms = tuple[RMSNorm, RMSNorm]


def _normalized(
    head_norms: HeadNorms | None, q: torch.Tensor, k: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    if head_norms is None:
        return q, k
    q_norm, k_norm = head_norms
    return q_norm.norm(q), k_norm.norm(k)


def inverse_frequencies(rope: RopeConfig, rotary_dim: int) -> torch.Tensor:
    """[rotary_dim // 2] fp32 inverse frequencies, scaled as the checkpoint asks."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_scale(inv_freq, rope)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling.

    Long wavelengths are slowed down by `factor`, short ones are kept, and the band between is
    blended smoothly; see the Llama 3 paper, section 3.3.
    """
    old_context = rope.original_max_position_embeddings or 8192
    low_freq_wavelen = old_context / rope.low_freq_factor
    high_freq_wavelen = old_context / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_context / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Holds cos and sin for every position up to `max_positions`, computed once in fp32."""

    def __init__(
        self, head_dim: int, max_positions: int, rope: RopeConfig, fused: bool = False
    ) -> None:
        super().__init__()
        self.fused = fused
        inv_freq = inverse_frequencies(rope, head_dim)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
        self.register_buffer("cos_cache", emb.cos(), persistent=False)
        self.register_buffer("sin_cache", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> RotaryAngles | FusedRotary:
        """What rotates q and k this step, looked up once and shared by every layer."""
        if self.fused:
            return FusedRotary(self.cos_cache, self.sin_cache, positions)
        if (  # in place: eager steps only (a traced graph keeps the formula, fused by inductor)
            dtype == torch.float32
            and cpu_extension.takes(self.cos_cache)
            and not torch.compiler.is_compiling()
        ):
            return FusedRotary(self.cos_cache, self.sin_cache, positions, cpu=True)
        cos = self.cos_cache[positions].unsqueeze(1).to(dtype)  # [num_tokens, 1, head_dim]
        sin = self.sin_cache[positions].unsqueeze(1).to(dtype)
        half = sin.shape[-1] // 2
        # rotate_half(x) * sin == roll(x, half) * [-sin_1, sin_2]: one roll instead of a split,
        # a negation and a concatenation per call, with bit-identical results.
        signed_sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        return RotaryAngles(cos, signed_sin)


@dataclass(frozen=True)
class RotaryAngles:
    cos: torch.Tensor  # [num_tokens, 1, head_dim]
    signed_sin: torch.Tensor  # [num_tokens, 1, head_dim], first half negated
    head_norms: HeadNorms | None = None

    def with_head_norms(self, q_norm: RMSNorm, k_norm: RMSNorm) -> RotaryAngles:
        """This rotation, after a layer's per-head RMSNorm of q and k (Qwen3)."""
        return dataclasses.replace(self, head_norms=(q_norm, k_norm))

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, num_heads, head_dim]
        return x * self.cos + x.roll(x.shape[-1] // 2, dims=-1) * self.signed_sin

    def rotate_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k = _normalized(self.head_norms, q, k)
        return self.rotate(q), self.rotate(k)


@dataclass(frozen=True)
class FusedRotary:
    """Rotates q and k in place with one kernel, reading the fp32 tables directly: Triton's, or
    with `cpu` the C++ one of `kernels/cpu_extension.py` (eager float32 steps on a CPU)."""

    cos_cache: torch.Tensor  # [max_positions, head_dim] fp32
    sin_cache: torch.Tensor
    positions: torch.Tensor  # [num_tokens]
    head_norms: HeadNorms | None = None
    cpu: bool = False

    def with_head_norms(self, q_norm: RMSNorm, k_norm: RMSNorm) -> FusedRotary:
        """This rotation, after a layer's per-head RMSNorm of q and k (Qwen3)."""
        return dataclasses.replace(self, head_norms=(q_norm, k_norm))

    def rotate_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k = _normalized(self.head_norms, q, k)
        if self.cpu:
            cpu_extension.rotary_(q, k, self.cos_cache, self.sin_cache, self.positions)
            return q, k
        from metrale.kernels.rotary import apply_rotary

        return apply_rotary(q, k, self.cos_cache, self.sin_cache, self.positions, q_out=q, k_out=k)

    def rotate_and_store(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Rotate q in place and write k rotated and v to their cache slots (k stays as it is):
        one kernel where the head norms, `rotate_qk` and `store_kv` are up to four."""
        from metrale.kernels.rotary_kv_store import rotary_kv_store

        weights = None
        if self.head_norms is not None:
            q_norm, k_norm = self.head_norms
            weights = (q_norm.weight, k_norm.weight, q_norm.eps)
        rotary_kv_store(
            q,
            k,
            v,
            self.cos_cache,
            self.sin_cache,
            self.positions,
            k_cache,
            v_cache,
            slot_mapping,
            weights,
        )
