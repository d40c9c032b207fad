"""A linear layer's weight kept in a GGUF quantized format (`--quantization gguf`).

It holds the three parts `kernels/quant_layout.py` describes, as buffers, so the weight takes
its quantized bytes wherever it lives. On a GPU the products read it packed
(`quant_gemv`, `quant_gemm`); elsewhere it is dequantized for each product, one layer at a time.
"""

from __future__ import annotations

import torch
from torch import nn

from metrale.kernels.quant_layout import (
    BLOCK,
    check_format,
    dequantize_ref,
    pack_ggml,
    qweight_columns,
    random_packed,
)


class PackedWeight(nn.Module):
    def __init__(self, fmt: str, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor):
        super().__init__()
        check_format(fmt)
        self.fmt = fmt
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)
        self.register_buffer("mins", mins)

    @classmethod
    def empty(cls, fmt: str, n: int, k: int, device: torch.device) -> PackedWeight:
        """Room for an [n, k] weight, filled by `copy_rows_`."""
        check_format(fmt)
        if k % BLOCK:
            raise ValueError(f"a {fmt} weight needs columns in multiples of {BLOCK}, not {k}")
        dtype = torch.int8 if fmt == "Q8_0" else torch.uint8
        qweight = torch.empty((n, qweight_columns(fmt, k)), dtype=dtype, device=device)
        scales = torch.empty((n, k // BLOCK), dtype=torch.float16, device=device)
        mins = torch.empty_like(scales) if fmt == "Q4_1" else scales.new_empty(0)
        return cls(fmt, qweight, scales, mins)

    @classmethod
    def from_ggml(cls, fmt: str, blocks: torch.Tensor) -> PackedWeight:
        """A weight in llama.cpp's block layout (uint8 [rows, bytes], as GGUF stores it)."""
        return cls(fmt, *pack_ggml(fmt, blocks))

    @classmethod
    def random(cls, fmt: str, n: int, k: int, device: torch.device, seed: int = 0) -> PackedWeight:
        return cls(fmt, *random_packed(fmt, n, k, device, seed))

    @property
    def shape(self) -> tuple[int, int]:
        return self.scales.shape[0], self.scales.shape[1] * BLOCK

    @property
    def parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.qweight, self.scales, self.mins

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parts)

    def copy_rows_(self, start: int, other: PackedWeight) -> None:
        """Rows start .. start + len(other) become `other`'s (a shard of a fused weight)."""
        if other.fmt != self.fmt or other.shape[1] != self.shape[1]:
            raise ValueError(
                f"a {other.fmt} shard of {other.shape[1]} columns cannot fill a {self.fmt} "
                f"weight of {self.shape[1]}"
            )
        for mine, theirs in zip(self.parts, other.parts, strict=True):
            if mine.numel():
                mine.narrow(0, start, theirs.shape[0]).copy_(theirs)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_ref(self.fmt, *self.parts, dtype)

    def extra_repr(self) -> str:
        n, k = self.shape
        return f"{self.fmt}, {n}x{k}"
