"""Linear layers whose one-row products can run the Triton `gemv` kernel (GPU)."""

from __future__ import annotations

from collections.abc import Callable

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


def silu_and_mul_linear(
    gate_up: torch.Tensor,
    weight: torch.Tensor,
    use_gemv: bool,
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """silu_and_mul(gate_up) @ weight.T, the MLP's down projection. With `use_gemv`, a one-row
    gate_up runs `gemv(silu_and_mul=True)`: the activation happens as the product loads its
    input, one kernel fewer per layer and no round trip of the activation through memory."""
    if use_gemv and gate_up.shape[0] == 1:
        from metrale.kernels.gemv import gemv

        return gemv(gate_up, weight, silu_and_mul=True)
    return F.linear(silu_and_mul(gate_up), weight)


class Linear(nn.Linear):
    """`fused`: one-row inputs take `gemv` (see `linear`)."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, fused: bool = False
    ) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.fused = fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.fused)
