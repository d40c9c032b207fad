"""RMSNorm, with the residual add fused in the way the decoder layers use it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (norm(x + residual), x + residual); the sum becomes the next residual.

        Computed in fp32 and cast back before the weight, the order Hugging Face uses, so bf16
        results match the reference bit for bit.
        """
        if residual is not None:
            x = x + residual
        residual = x
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype), residual

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward(x)[0]
