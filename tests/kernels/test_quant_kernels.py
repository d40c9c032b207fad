"""The packed GGUF weights: the repacked layout dequantizes exactly as the `gguf` package does,
`quant_gemv` and `quant_gemm` match their torch references, and a model whose linear layers
are packed computes with the kernels what it computes with each layer dequantized."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from metrale.config import CacheConfig, ModelConfig, SchedulerConfig
from metrale.engine.step import ScheduledChunk, SchedulerOutput
from metrale.kernels.quant_dequantize import dequantize
from metrale.kernels.quant_gemm import quant_gemm, quant_gemm_ref
from metrale.kernels.quant_gemv import quant_gemv, quant_gemv_ref
from metrale.kernels.quant_layout import FORMATS, dequantize_ref, pack_ggml
from metrale.layers.linear import Linear
from metrale.layers.packed_weight import PackedWeight
from metrale.models import model_class_for
from metrale.runner.model_runner import ModelRunner
from metrale.sampling_params import SamplingParams
from tests.conftest import build_checkpoint

gguf = pytest.importorskip("gguf")
ON_GPU = torch.cuda.is_available()


def quantized(fmt: str, n: int, k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(llama.cpp's blocks, the gguf package's dequantization) of a random [n, k] weight."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    kind = gguf.GGMLQuantizationType[fmt]
    blocks = gguf.quants.quantize(w, kind)
    return blocks, gguf.quants.dequantize(blocks, kind)


def packed(fmt: str, n: int, k: int, device, seed: int = 0) -> PackedWeight:
    blocks, _ = quantized(fmt, n, k, seed)
    return PackedWeight.from_ggml(fmt, torch.from_numpy(blocks)).to(device)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_repacked_layout_dequantizes_as_gguf_does(fmt) -> None:
    blocks, reference = quantized(fmt, 7, 96, seed=1)
    parts = pack_ggml(fmt, torch.from_numpy(blocks))
    assert torch.equal(dequantize_ref(fmt, *parts), torch.from_numpy(reference))
    # Same bytes as llama.cpp's blocks: nothing is widened.
    assert sum(t.numel() * t.element_size() for t in parts) == blocks.nbytes


def test_a_format_that_cannot_stay_packed_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="Q4_K weights cannot stay packed"):
        PackedWeight.empty("Q4_K", 4, 64, torch.device("cpu"))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n,k", [(16, 64), (37, 160), (5, 576)])
@pytest.mark.parametrize("bias", [False, True])
def test_quant_gemv_matches_reference(device, fmt, n, k, bias) -> None:
    weight = packed(fmt, n, k, device, seed=n + k)
    x = torch.randn(1, k, device=device)
    b = torch.randn(n, device=device) if bias else None
    for launch in ({}, {"block_n": 4, "block_k": 64, "num_warps": 2}):
        torch.testing.assert_close(
            quant_gemv(x, fmt, *weight.parts, b, **launch),
            quant_gemv_ref(x, fmt, *weight.parts, b),
            atol=1e-4,
            rtol=1e-4,
        )


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m,n,k", [(2, 16, 64), (20, 37, 160), (70, 24, 96)])
def test_quant_gemm_matches_reference(device, fmt, m, n, k) -> None:
    weight = packed(fmt, n, k, device, seed=m)
    x = torch.randn(m, k, device=device)
    b = torch.randn(n, device=device)
    small = (16, 16, 64, 2, 1)  # several programs in each direction and a ragged last K tile
    for blocks in (None, small) if not ON_GPU else (None,):
        torch.testing.assert_close(
            quant_gemm(x, fmt, *weight.parts, b, blocks=blocks),
            quant_gemm_ref(x, fmt, *weight.parts, b),
            atol=1e-4,
            rtol=1e-4,
        )


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_dequantize_kernel_is_the_reference_rounded(device, fmt) -> None:
    weight = packed(fmt, 19, 320, device, seed=5)
    reference = dequantize_ref(fmt, *weight.parts)
    assert torch.equal(dequantize(fmt, *weight.parts, torch.float32), reference)
    if ON_GPU:
        half = dequantize(fmt, *weight.parts, torch.bfloat16)
        assert torch.equal(half, reference.to(torch.bfloat16))


@pytest.mark.parametrize("fmt", FORMATS)
def test_many_rows_take_the_dequantized_weight_and_cublas(device, fmt) -> None:
    weight = packed(fmt, 24, 96, device, seed=2)
    x = torch.randn(40, 96, device=device)
    b = torch.randn(24, device=device)
    torch.testing.assert_close(
        quant_gemm(x, fmt, *weight.parts, b, dequantize_rows=32),
        quant_gemm_ref(x, fmt, *weight.parts, b),
        atol=1e-4,
        rtol=1e-4,
    )


@pytest.mark.skipif(not ON_GPU, reason="half precision products: GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", FORMATS)
def test_half_precision_products_round_the_weight_as_the_dequantized_checkpoint(dtype, fmt):
    """Up to one unit in the last place of the output's dtype: the float32 sums differ in
    order only."""
    weight = packed(fmt, 300, 1024, "cuda", seed=3)
    x = torch.randn(33, 1024, device="cuda", dtype=dtype)
    ulp = torch.finfo(dtype).eps
    for ours, ref in (
        (quant_gemm(x, fmt, *weight.parts), quant_gemm_ref(x, fmt, *weight.parts)),
        (quant_gemv(x[:1], fmt, *weight.parts), quant_gemv_ref(x[:1], fmt, *weight.parts)),
    ):
        torch.testing.assert_close(ours.float(), ref.float(), rtol=2 * ulp, atol=1e-2)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_packed_model_computes_with_the_kernels_what_it_computes_dequantized(
    tmp_path, device, fmt
) -> None:
    model_config = ModelConfig.from_dir(build_checkpoint(tmp_path, "qwen2"))  # q/k/v biases too
    model_config = dataclasses.replace(model_config, max_position_embeddings=128)
    cls = model_class_for(model_config.architecture)
    cache = CacheConfig(
        block_size=16, num_blocks=8, enable_prefix_caching=False, dtype=torch.float32
    )
    scheduler = SchedulerConfig(4, 4, 64, 64, 128)
    params = SamplingParams(temperature=0, logprobs=3)
    steps = [
        [
            ScheduledChunk("a", list(range(10, 30)), 0, [0, 1], True, params),
            ScheduledChunk("b", list(range(40, 47)), 0, [2], True, params),
        ],
        [ScheduledChunk("a", [77], 20, [0, 1], True, params)],  # one row: quant_gemv
    ]
    torch.manual_seed(0)
    state = None
    results = []
    for fused in (False, True):
        with torch.device(device):
            model = cls(model_config, fused_kernels=fused).eval()
        layers = [m for m in model.modules() if isinstance(m, Linear)]
        for i, layer in enumerate(layers):
            layer.pack_(fmt)
            n, k = layer.packed.shape
            layer.packed.copy_rows_(0, packed(fmt, n, k, device, seed=i))
        if state is None:
            for p in model.parameters():  # the rest: embeddings, norms, biases
                p.data.normal_(0, 0.15)
            state = model.state_dict()
        model.load_state_dict(state)
        runner = ModelRunner(
            model, model_config, cache, scheduler, torch.device(device), attention_backend="torch"
        )
        results.append([runner.execute(SchedulerOutput(step)) for step in steps])
    for dequantized, kernels in zip(*results, strict=True):
        assert kernels.sampled_token_ids == dequantized.sampled_token_ids
        for a, b in zip(kernels.logprobs, dequantized.logprobs, strict=True):
            assert abs(a.logprob - b.logprob) < 1e-4
