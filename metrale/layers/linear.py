"""Linear layers whose one-row products can run the Triton `gemv` kernel (GPU), whose weight can
stay in a GGUF quantized format (`PackedWeight`, `--quantization gguf`), and which on a CPU
multiply through Metrale's panel kernel (float32) or oneDNN with the weight in their own layout
(`prepack_for_cpu`).

Under tensor parallelism the layers know their split (`distributed/sharding.py`): a
column-parallel layer holds its rank's output features and gives them on unreduced, a
row-parallel one its input features and all-reduces its partial sums, and the head its slice of
the vocabulary, gathered. Each says which part of a checkpoint tensor it loads
(`checkpoint_slice`); with one rank that is the whole tensor (None) and the layers run as
`Linear` does, no collective.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from metrale import envs
from metrale.distributed.parallel_state import all_reduce, gather_to_first, tp_rank, tp_size
from metrale.distributed.sharding import TensorSlice, vocab_slice
from metrale.layers.packed_weight import PackedWeight

_HALF = (torch.bfloat16, torch.float16)  # the dtypes `float32_linear` takes


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


def float32_linear(x: torch.Tensor, weight: torch.Tensor, use_gemv: bool) -> torch.Tensor:
    """x @ weight.T in float32 from a half-precision x and weight on a GPU: the product's fp32
    accumulator written as it is, where `linear` then `.float()` would round it to x's dtype and
    read it back in a second pass (at B2's 256 rows, 78 MB of Qwen3's logits read and 156 MB
    written again every step)."""
    if use_gemv and x.shape[0] == 1:
        from metrale.kernels.gemv import gemv

        return gemv(x, weight, out_dtype=torch.float32)
    return torch.mm(x, weight.t(), out_dtype=torch.float32)


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

        return down.reduce(gemv(gate_up, down.weight, silu_and_mul=True))
    return down(silu_and_mul(gate_up))


def streamed_product(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x @ weight.T (+ bias) as a reduction, for a one-row product inside a compiled CPU decode
    step (`runner/compiled_decode.py`): inductor turns it into a loop that streams the dense
    weight, 1.3-1.5x the rate of oneDNN's one-row product on 2 cores (and of torch's, 2.5x)."""
    out = (x[:, None, :] * weight[None]).sum(-1)
    return out if bias is None else out + bias


def compiled_product(layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A product inside a compiled CPU decode step. One row reads the layer's packed GGUF copy
    where it has one (`decode_packed`, read by `kernels/cpu_extension.py`), else streams its
    dense weight; several rows (or a layer with neither) go through the layer's packed weight, as
    eager steps do: Metrale's panels (float32), else oneDNN's layout. (In a graph of several rows
    the row count is a symbol known to be 2 or more, so the test of one row costs no guard.)"""
    if x.shape[0] == 1 and layer.decode_packed is not None:
        from metrale.kernels.cpu_extension import packed_gemv

        out = packed_gemv(x, layer.decode_packed.fmt, *layer.decode_packed.parts)
        return out if bias is None else out + bias
    if x.shape[0] == 1 and layer.weight is not None:
        return streamed_product(x, layer.weight, bias)
    if layer.panels is not None:
        return _panel_product(x, layer.panels, bias, layer.out_features)
    if layer.onednn_id is not None:
        return torch.ops.metrale.onednn_linear(x, layer.onednn_id, bias)
    return F.linear(x, layer.weight, bias)


def _panel_product(
    x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, n: int
) -> torch.Tensor:
    """x [..., K] @ W.T (+ bias) over W's panels: [..., n] (`cpu_extension.panel_linear`'s op,
    called as it is: eager steps and compiled graphs alike)."""
    if x.dim() == 2:
        return torch.ops.metrale_cpu.panel_linear(x, panels, bias, n)
    out = torch.ops.metrale_cpu.panel_linear(x.reshape(-1, x.shape[-1]), panels, bias, n)
    return out.view(*x.shape[:-1], n)


# oneDNN's product as an op a compiled graph calls as it is. Inductor lowers its own oneDNN
# linear only over weights it froze into the graph itself, and an opaque oneDNN tensor cannot be
# a graph's input; so the graph names the layer by a number and the op looks its weight up.
_LIB = torch.library.Library("metrale", "FRAGMENT")
_LIB.define("onednn_linear(Tensor x, int layer, Tensor? bias) -> Tensor")
_ONEDNN_LAYERS: weakref.WeakValueDictionary[int, Linear] = weakref.WeakValueDictionary()
_onednn_ids = itertools.count()


def _onednn_linear(x: torch.Tensor, layer: int, bias: torch.Tensor | None) -> torch.Tensor:
    weight = _ONEDNN_LAYERS[layer].onednn
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


_LIB.impl("onednn_linear", _onednn_linear, "CPU")


@torch.library.register_fake("metrale::onednn_linear")
def _(x, layer, bias):
    return x.new_empty((x.shape[0], _ONEDNN_LAYERS[layer].onednn.shape[0]))


# The batch size oneDNN lays a weight out for. One layout serves every step, and the one for 256
# rows measured best at every size a step has (2 cores, fp32, peers.md's 33.6M Llama's weights:
# 16 rows 1.6-2.0x faster than the layout for 1 row, prefill chunks of 512-2048 rows as fast or
# faster, one row no slower; the layout for 2,048 rows lost at 16).
ONEDNN_LAYOUT_ROWS = 256


def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN lays out and multiplies weights of `dtype` on this CPU: its 16-bit paths
    need AVX-512 (bf16: AVX512BW/VL/DQ, fp16: AVX512-FP16) or AVX-NE-CONVERT, and refuse to
    pack on an AVX2-only CPU, where torch's own product takes those weights."""
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if dtype == torch.float16:
        return torch.ops.mkldnn._is_mkldnn_fp16_supported()
    return dtype == torch.float32


def prepack_for_cpu(model: nn.Module, keep_dense: bool = False) -> int:
    """Give every dense `Linear` of a CPU model its weight in the layout its products read, the
    dense copy dropped unless `keep_dense` (compiled one-row decode steps stream it; a layer with
    a `decode_packed` copy reads that instead); the number of layers packed (0 with
    METRALE_ONEDNN=0, which keeps torch's own products).

    A float32 weight goes into panels of output columns for Metrale's C++ product
    (`kernels/cpu/panel_linear.cpp`) where the CPU kernels build: 2-16 rows (decode steps of
    several streams) of peers.md's 33.6M Llama 1.4-1.6x oneDNN's product over its own layout,
    which reads the weights at ~2/3 of the bandwidth at those sizes (bench/cpu_products.py).
    Others (bfloat16, float16, or no kernels: METRALE_CPU_KERNELS=0) go into oneDNN's layout
    where oneDNN takes their dtype on this CPU (`onednn_packs`), else stay dense.

    torch's CPU products of one row run on one core (bench/profile_cpu.py: 33.6M-parameter
    Llama, fp32, 2 cores: a decode step's products read 13 GB/s of the machine's 27-40); through
    oneDNN's prepacked weights the same bench's decode steps run 1.78x faster at one stream and
    1.84x at sixteen (METRALE_ONEDNN=0 against 1), with the same greedy tokens."""
    if not envs.onednn():
        return 0
    from metrale.kernels import cpu_extension

    panels = cpu_extension.enabled()
    onednn = torch.backends.mkldnn.is_available()
    packed = 0
    for layer in model.modules():
        # fused layers run the Triton kernels (on a CPU: the interpreter's tests of them)
        if not isinstance(layer, Linear) or layer.weight is None or layer.fused:
            continue
        if layer.weight.device.type != "cpu":
            continue
        keep = keep_dense and layer.decode_packed is None
        if panels and layer.weight.dtype == torch.float32:
            layer.panel_pack_(keep)
        elif onednn and onednn_packs(layer.weight.dtype):
            layer.onednn_pack_(keep)
        else:
            continue
        packed += 1
    return packed


class Linear(nn.Linear):
    """`fused`: one-row inputs take `gemv` (see `linear`), and a packed weight the quantized
    kernels (see `packed_linear`). `panels` or `onednn`: the weight in the layout of Metrale's
    CPU product or of oneDNN's (`prepack_for_cpu`); then `weight` is None unless compiled steps
    read it. `decode_packed`: on a CPU serving a GGUF file dequantized, the file's packed blocks
    of the weight too, which compiled one-row decode steps read (`compiled_product`), a fraction
    of the dense weight's bytes."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, fused: bool = False
    ) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.fused = fused
        self.packed: PackedWeight | None = None
        self.onednn: torch.Tensor | None = None
        self.decode_packed: PackedWeight | None = None
        self.onednn_id: int | None = None  # `onednn`'s number for compiled graphs
        self.panels: torch.Tensor | None = None

    @property
    def compiles(self) -> bool:
        """Whether a compiled CPU step can run this layer's product (`compiled_product`)."""
        return (
            self.weight is not None
            or self.decode_packed is not None
            or self.onednn is not None
            or self.panels is not None
        )

    def pack_(self, fmt: str) -> None:
        """Give up the dense weight for a packed one of `fmt`, to be filled by loading."""
        device = self.weight.device
        del self.weight
        self.register_parameter("weight", None)
        self.packed = PackedWeight.empty(fmt, self.out_features, self.in_features, device)

    def onednn_pack_(self, keep_dense: bool = False) -> None:
        """The weight in oneDNN's blocked layout (an opaque tensor, the same bytes), the dense
        one dropped unless `keep_dense` (if the weight is shared, as a tied head's is, its owner
        keeps it)."""
        self.onednn = torch.ops.mkldnn._reorder_linear_weight(
            self.weight.detach(), ONEDNN_LAYOUT_ROWS
        )
        self.onednn_id = next(_onednn_ids)
        _ONEDNN_LAYERS[self.onednn_id] = self
        if not keep_dense:
            del self.weight
            self.register_parameter("weight", None)

    def panel_pack_(self, keep_dense: bool = False) -> None:
        """The float32 weight in panels of output columns (`cpu_extension.pack_panels`), the
        dense one dropped unless `keep_dense` (as `onednn_pack_`)."""
        from metrale.kernels import cpu_extension

        self.panels = cpu_extension.pack_panels(self.weight)
        if not keep_dense:
            del self.weight
            self.register_parameter("weight", None)

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.weight is not None:
            return
        if self.onednn is not None:  # read back out of oneDNN's layout
            destination[prefix + "weight"] = self.onednn.to_dense()
        elif self.panels is not None:  # [P, K, L] -> [P * L, K], the padding cut off
            p, k, lanes = self.panels.shape
            dense = self.panels.transpose(1, 2).reshape(p * lanes, k)
            destination[prefix + "weight"] = dense[: self.out_features].clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # `product`'s body inlined: the hot path of every unsplit layer, one call fewer
        if torch.compiler.is_compiling() and self.compiles:  # a compiled CPU step
            return compiled_product(self, x, self.bias)
        if self.panels is not None:
            return _panel_product(x, self.panels, self.bias, self.out_features)
        if self.onednn is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.onednn, self.bias, "none", [], "")
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias, self.fused)
        return linear(x, self.weight, self.bias, self.fused)

    def product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ weight.T (+ `bias`), this rank's part only."""
        if torch.compiler.is_compiling() and self.compiles:  # a compiled CPU step
            return compiled_product(self, x, bias)
        if self.panels is not None:
            return _panel_product(x, self.panels, bias, self.out_features)
        if self.onednn is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.onednn, bias, "none", [], "")
        if self.packed is not None:
            return packed_linear(x, self.packed, bias, self.fused)
        return linear(x, self.weight, bias, self.fused)

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """A product computed outside `forward` (`silu_and_mul_linear`) made whole: a
        row-parallel layer sums it over the ranks; any other returns it."""
        return partial


class ColumnParallelLinear(Linear):
    """Output features split across ranks. It holds this rank's rows of each checkpoint tensor
    fused into it (q/k/v, gate/up, or just one), end to end, and its output is this rank's
    features of each, unreduced: the row-parallel layer after it takes them as they are."""

    def __init__(
        self, in_features: int, shards: Sequence[TensorSlice], bias: bool, fused: bool = False
    ) -> None:
        super().__init__(in_features, sum(s.length for s in shards), bias, fused)
        self.shards = tuple(shards)  # each checkpoint tensor's rows, along dim 0
        self.split = tp_size() > 1

    def shard_offset(self, shard: int) -> int:
        """The first row of the fused weight that checkpoint tensor `shard` fills."""
        return sum(s.length for s in self.shards[:shard])

    def checkpoint_slice(self, kind: str, shard: int) -> TensorSlice | None:
        return self.shards[shard] if self.split else None  # the bias splits as the weight


class RowParallelLinear(Linear):
    """Input features split across ranks (`in_slice` of the checkpoint's columns): each rank's
    product is a partial sum, all-reduced once, the bias added once after the reduce."""

    def __init__(
        self, in_slice: TensorSlice, out_features: int, bias: bool, fused: bool = False
    ) -> None:
        super().__init__(in_slice.length, out_features, bias, fused)
        self.in_slice = TensorSlice(1, in_slice.start, in_slice.length)
        self.split = tp_size() > 1

    def checkpoint_slice(self, kind: str, shard: int) -> TensorSlice | None:
        return self.in_slice if self.split and kind == "weight" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.split:
            return self.reduce(self.product(x, None))
        return Linear.forward(self, x)  # not super(): the cheaper call, on every layer

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        if not self.split:
            return partial
        out = all_reduce(partial)
        return out if self.bias is None else out.add_(self.bias)


class ParallelLMHead(Linear):
    """The vocabulary split across ranks as `VocabParallelEmbedding` splits it (padded to a
    multiple of the ranks): each rank computes its slice of the logits, gathered on rank 0 (which
    samples; the others get None), the padding cut off. The runner calls it only on the rows
    that sample."""

    def __init__(self, hidden_size: int, vocab_size: int, fused: bool = False) -> None:
        rows, rows_per_rank = vocab_slice(vocab_size, tp_rank(), tp_size())
        super().__init__(hidden_size, rows_per_rank, bias=False, fused=fused)
        self.vocab_slice = rows
        self.vocab_size = vocab_size
        self.split = tp_size() > 1

    def checkpoint_slice(self, kind: str, shard: int) -> TensorSlice | None:
        return self.vocab_slice if self.split else None

    @property
    def fp32_logits(self) -> bool:
        """Whether the product writes float32 logits itself (`float32_linear`): a dense weight
        with the GPU's kernels. The sampler takes logits in float32 either way."""
        return self.fused and self.weight is not None and self.weight.is_cuda

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        if self.fp32_logits and x.dtype in _HALF:
            logits = float32_linear(x, self.weight, self.fused)
        else:
            logits = Linear.forward(self, x)  # [num_rows, rows_per_rank]
        if not self.split:
            return logits
        logits = gather_to_first(logits, dim=-1)  # [num_rows, padded vocab] on rank 0
        if logits is None or logits.shape[-1] == self.vocab_size:
            return logits
        return logits[:, : self.vocab_size].contiguous()
