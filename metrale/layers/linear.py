"""Linear layers whose one-row products can run the Triton `gemv` kernel (GPU), and whose weight
can stay in a GGUF quantized format (`PackedWeight`, `--quantization gguf`)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from metrale.layers.packed_weight import PackedWeight


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


def packed_linear(
    x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None, use_kernels: bool
) -> torch.Tensor:
    """x @ dequant(weight).T (+ bias). With `use_kernels` (GPU) the product reads the weight
    packed: `quant_gemv` for one row, `quant_gemm` for more; otherwise the weight is
    dequantized to x's dtype for this product alone."""
    if use_kernels:
        if x.shape[0] == 1:
            from metrale.kernels.quant_gemv import quant_gemv

            return quant_gemv(x, weight.fmt, *weight.parts, bias)
        from metrale.kernels.quant_gemm import quant_gemm

        return quant_gemm(x, weight.fmt, *weight.parts, bias)
    return F.linear(x, weight.dequantize(x.dtype), bias)


def silu_and_mul_linear(
    gate_up: torch.Tensor, down: Linear, silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """down(silu_and_mul(gate_up)), the MLP's down projection. With `down.fused`, a one-row
    gate_up runs `gemv(silu_and_mul=True)`: the activation happens as the product loads its
    input, one kernel fewer per layer and no round trip of the activation through memory."""
    if down.packed is None and down.fused and gate_up.shape[0] == 1:
        from metrale.kernels.gemv import gemv

        return gemv(gate_up, down.weight, silu_and_mul=True)
    return down(silu_and_mul(gate_up))


class Linear(nn.Linear):
    """`fused`: one-row inputs take `gemv` (see `linear`), and a packed weight the quantized
    kernels (see `packed_linear`)."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, fused: bool = False
    ) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.fused = fused
        self.packed: PackedWeight | None = None

    def pack_(self, fmt: str) -> None:
        """Give up the dense weight for a packed one of `fmt`, to be filled by loading."""
        device = self.weight.device
        del self.weight
        self.register_parameter("weight", None)
        self.packed = PackedWeight.empty(fmt, self.out_features, self.in_features, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias, self.fused)
        return linear(x, self.weight, self.bias, self.fused)
