"""How packed GGUF weights lie in memory for the dequantize-in-the-loop kernels, and a torch
dequantizer that is their reference (and the CPU path).

GGUF's Q8_0, Q4_0 and Q4_1 quantize each row in blocks of 32 values that share a float16 scale
`d` (and, for Q4_1, a float16 offset `m`):

    Q8_0: w = d * q,        q int8
    Q4_0: w = d * (q - 8),  q in 0..15
    Q4_1: w = d * q + m,    q in 0..15

llama.cpp keeps each block's scale next to its values (34, 18 or 20 bytes a block), and a 4-bit
block's byte j holds its values j and j + 16. Here the parts are split into three row-major
tensors, same bytes in all, so a kernel's tile of columns is one contiguous load of each:

    qweight  [N, K] int8 (Q8_0) or [N, K / 2] uint8 (4-bit: byte j holds column 2j in its low
             nibble and column 2j + 1 in its high one)
    scales   [N, K / 32] float16
    mins     [N, K / 32] float16 (Q4_1; an empty tensor otherwise)
"""

from __future__ import annotations

import torch

BLOCK = 32  # values per scale, in every format here
FORMATS = ("Q8_0", "Q4_0", "Q4_1")
# Bytes of one block in llama.cpp's layout.
GGML_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}
# The kernels' FORMAT constant.
FORMAT_IDS = {name: i for i, name in enumerate(FORMATS)}


def check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"{fmt} weights cannot stay packed: use one of {', '.join(FORMATS)}")


def qweight_columns(fmt: str, k: int) -> int:
    """Columns of `qweight` for a weight of k columns."""
    return k if fmt == "Q8_0" else k // 2


def pack_ggml(fmt: str, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(qweight, scales, mins) of a weight in llama.cpp's layout: `blocks` is uint8
    [rows, K / 32 * block bytes], as a GGUF file stores the tensor."""
    check_format(fmt)
    rows = blocks.shape[0]
    per_block = GGML_BLOCK_BYTES[fmt]
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] % per_block:
        raise ValueError(f"{fmt} blocks must be uint8 [rows, n * {per_block}]")
    by_block = blocks.reshape(rows, -1, per_block)
    header = 4 if fmt == "Q4_1" else 2
    halves = by_block[..., :header].contiguous().view(torch.float16)  # [rows, blocks, 1 or 2]
    scales = halves[..., 0].contiguous()
    mins = halves[..., 1].contiguous() if fmt == "Q4_1" else scales.new_empty(0)
    values = by_block[..., header:]
    if fmt == "Q8_0":
        return values.contiguous().view(torch.int8).reshape(rows, -1), scales, mins
    # llama.cpp: byte j of a block holds values j (low nibble) and j + 16 (high nibble).
    nibbles = torch.cat((values & 15, values >> 4), dim=-1)  # [rows, blocks, 32] in order
    qweight = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)
    return qweight.reshape(rows, -1).contiguous(), scales, mins


def check_packed(
    fmt: str,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> tuple[int, int]:
    """(N, K) of a packed weight whose parts (and bias) a kernel can read, or an AssertionError."""
    check_format(fmt)
    n, groups = scales.shape
    k = groups * BLOCK
    assert qweight.shape == (n, qweight_columns(fmt, k)) and qweight.is_contiguous()
    assert scales.is_contiguous() and (fmt != "Q4_1" or mins.shape == scales.shape)
    assert bias is None or bias.shape == (n,), f"bias must be [{n}]"
    return n, k


def matmul_ref(
    x: torch.Tensor,
    fmt: str,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    bias: torch.Tensor | None,
    weight_dtype: torch.dtype,
) -> torch.Tensor:
    """x @ W.T (+ bias) in float32, W dequantized to `weight_dtype`, cast back to x's dtype: the
    reference of the quantized products."""
    w = dequantize_ref(fmt, qweight, scales, mins, weight_dtype).float()
    y = x.float() @ w.t()
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)


def dequantize_ref(
    fmt: str,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The [N, K] weight in `dtype`, computed in float32 as `gguf.quants.dequantize` does."""
    check_format(fmt)
    n, blocks = scales.shape
    if fmt == "Q8_0":
        q = qweight.float()
    else:
        q = torch.stack((qweight & 15, qweight >> 4), dim=-1).reshape(n, -1).float()
        if fmt == "Q4_0":
            q -= 8
    w = q.view(n, blocks, BLOCK) * scales.float()[..., None]
    if fmt == "Q4_1":
        w += mins.float()[..., None]
    return w.reshape(n, blocks * BLOCK).to(dtype)


def random_packed(
    fmt: str, n: int, k: int, device: torch.device | str, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random (qweight, scales, mins) of an [n, k] weight with values of a trained layer's size
    (about +-0.05), made on `device`: benchmarks on random weights of real shapes."""
    check_format(fmt)
    gen = torch.Generator(device=device).manual_seed(seed)
    cols = qweight_columns(fmt, k)
    low, high = (-127, 128) if fmt == "Q8_0" else (0, 256)
    qweight = torch.randint(low, high, (n, cols), generator=gen, device=device, dtype=torch.int16)
    qweight = qweight.to(torch.int8 if fmt == "Q8_0" else torch.uint8)
    scale = 0.05 / (127 if fmt == "Q8_0" else 8)
    scales = torch.rand((n, k // BLOCK), generator=gen, device=device) * scale + scale / 2
    scales = scales.half()
    mins = -8 * scales if fmt == "Q4_1" else scales.new_empty(0)
    return qweight, scales, mins
