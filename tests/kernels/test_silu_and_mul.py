"""The SiLU-and-mul kernel against `silu_and_mul_ref`, with every output element written."""

from __future__ import annotations

import pytest
import torch

from metrale.kernels.silu_and_mul import BLOCK, silu_and_mul, silu_and_mul_ref

ON_GPU = torch.cuda.is_available()
DTYPES = [torch.float32, torch.bfloat16, torch.float16] if ON_GPU else [torch.float32]
# 48 fits one program; BLOCK + 76 leaves a ragged second block.
INTERMEDIATE_SIZES = [48, BLOCK + 76]
NUM_TOKENS = [1, 7, 33]
requires_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")


def assert_matches(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert not actual.isnan().any(), "the kernel left elements unwritten (NaN poison remains)"
    tol = 1e-5 if actual.dtype == torch.float32 else 1e-2
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("intermediate", INTERMEDIATE_SIZES)
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
def test_matches_reference(
    device: torch.device, dtype: torch.dtype, intermediate: int, num_tokens: int
) -> None:
    torch.manual_seed(num_tokens * 10_000 + intermediate)
    gate_up = (3 * torch.randn(num_tokens, 2 * intermediate, device=device)).to(dtype)
    out = torch.full((num_tokens, intermediate), float("nan"), dtype=dtype, device=device)
    assert silu_and_mul(gate_up, out=out) is out
    assert_matches(out, silu_and_mul_ref(gate_up))


def test_allocates_contiguous_output_by_default(device: torch.device) -> None:
    torch.manual_seed(0)
    gate_up = torch.randn(3, 2 * 48, device=device)
    out = silu_and_mul(gate_up)
    assert out.shape == (3, 48) and out.is_contiguous()
    assert_matches(out, silu_and_mul_ref(gate_up))


def test_strided_rows(device: torch.device) -> None:
    """gate_up and out may be column slices of wider buffers."""
    torch.manual_seed(1)
    intermediate = 40
    gate_up = torch.randn(4, 3 * intermediate, device=device)[:, : 2 * intermediate]
    out = torch.full((4, 2 * intermediate), float("nan"), device=device)[:, intermediate:]
    silu_and_mul(gate_up, out=out)
    assert_matches(out, silu_and_mul_ref(gate_up))


# The interpreter computes with numpy, which warns when exp overflows to inf.
@pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning")
def test_extreme_values(device: torch.device) -> None:
    """exp(-gate) overflows for very negative gates; silu must still go to -0, not NaN."""
    gate = torch.tensor([[-1000.0, -100.0, -88.0, -20.0, 0.0, 20.0, 88.0, 100.0, 1000.0]])
    gate_up = torch.cat((gate, torch.full_like(gate, 1.5)), dim=-1).to(device)
    assert_matches(silu_and_mul(gate_up), silu_and_mul_ref(gate_up))


def test_rejects_bad_inputs(device: torch.device) -> None:
    with pytest.raises(AssertionError, match="odd"):
        silu_and_mul(torch.randn(2, 7, device=device))
    with pytest.raises(AssertionError, match="contiguous last dim"):
        silu_and_mul(torch.randn(8, 2, device=device).t())
    with pytest.raises(AssertionError, match="out is"):
        silu_and_mul(torch.randn(2, 8, device=device), out=torch.empty(2, 8, device=device))


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("num_tokens", [1, 17, 256, 8192])
def test_llama3_8b_shapes(num_tokens: int) -> None:
    torch.manual_seed(num_tokens)
    gate_up = torch.randn(num_tokens, 2 * 14336, device="cuda").to(torch.bfloat16)
    assert_matches(silu_and_mul(gate_up), silu_and_mul_ref(gate_up))


@pytest.mark.gpu
@requires_gpu
def test_cuda_graph_capture() -> None:
    gate_up = torch.randn(64, 2 * 14336, device="cuda").to(torch.bfloat16)
    silu_and_mul(gate_up)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = silu_and_mul(gate_up)
    new_gate_up = torch.randn_like(gate_up)
    gate_up.copy_(new_gate_up)
    graph.replay()
    torch.cuda.synchronize()
    assert_matches(out, silu_and_mul_ref(new_gate_up))
