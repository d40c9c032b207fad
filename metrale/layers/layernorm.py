"""RMSNorm, with the residual add fused in the way the decoder layers use it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from metrale.kernels import cpu_extension


class RMSNorm(nn.Module):
    """`fused`: one Triton kernel (residual add, norm, weight) instead of a chain of torch ops."""

    def __init__(self, hidden_size: int, eps: float, fused: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self._kernel = None
        if fused:
            from metrale.kernels.rms_norm import rms_norm

            self._kernel = rms_norm

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (norm(x + residual), x + residual); the sum becomes the next residual.

        Computed in fp32 and cast back before the weight, the order Hugging Face uses, so bf16
        results match the reference bit for bit.
        """
        if self._kernel is not None:
            return self._kernel(x, self.weight, self.eps, residual)
        if x.dim() == 2 and cpu_extension.takes(x):  # one pass where torch takes four
            return cpu_extension.rms_norm(x, residual, self.weight, self.eps)
        if residual is not None:
            x = x + residual
        residual = x
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype), residual

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        """Normalize over the last dim of a tensor of any rank (Qwen3's per-head q/k norms)."""
        if self._kernel is not None or cpu_extension.takes(x):
            return self.forward(x.reshape(-1, x.shape[-1]))[0].view(x.shape)
        return self.forward(x)[0]
