"""Linear layers whose one-row products can run the Triton `gemv` kernel (GPU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, use_gemv: bool
) -> torch.Tensor:
    """x @ weight.T (+ bias). With `use_gemv`, a one-row x (a batch-1 decode step) runs `gemv`,
    which reads Llama-3.1-8B's weights 1.03-1.31x faster than cuBLAS does at one row
    (bench/gemv.py on the H200); a CUDA graph captures either path at its batch size."""
    if use_gemv and x.shape[0] == 1:
        from metrale.kernels.gemv import gemv

        return gemv(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """`fused`: one-row inputs take `gemv` (see `linear`)."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, fused: bool = False
    ) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.fused = fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.fused)
