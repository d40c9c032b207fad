"""The RMSNorm kernel against `rms_norm_ref`: every element written, every rounding point kept.

In Triton's interpreter (no GPU) only fp32 at small shapes runs; on a GPU also bf16/fp16 at
model widths, where the kernel may differ from the reference only by the order of the sum of
squares.
"""

from __future__ import annotations

import pytest
import torch

from metrale.kernels.rms_norm import rms_norm, rms_norm_ref

ON_GPU = torch.cuda.is_available()
DTYPES = [torch.float32, torch.bfloat16, torch.float16] if ON_GPU else [torch.float32]
HIDDEN_SIZES = [96, 4096 + 64]
NUM_TOKENS = [1, 7, 33]
EPS = 1e-6
requires_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many representable 16-bit floats (bf16 or fp16) lie between a and b, elementwise."""
    assert a.dtype == b.dtype and a.dtype in (torch.bfloat16, torch.float16)

    def ordered(t: torch.Tensor) -> torch.Tensor:
        # Sign-magnitude bits -> an integer line where neighbouring floats are 1 apart.
        bits = t.view(torch.int16).int()
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)

    return (ordered(a) - ordered(b)).abs()


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, max_ulps: int = 2) -> None:
    """fp32: tight tolerance. 16-bit: within `max_ulps`, and almost every element bit-exact."""
    assert not actual.isnan().any(), "the kernel left elements unwritten (NaN poison remains)"
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
        return
    ulps = ulp_distance(actual, expected)
    assert ulps.max().item() <= max_ulps, f"{ulps.max().item()} ulps apart"
    assert (ulps == 0).float().mean().item() > 0.99, "too few elements match bit for bit"


def random_inputs(
    num_tokens: int, hidden: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.randn(num_tokens, hidden, device=device).to(dtype)
    residual = torch.randn(num_tokens, hidden, device=device).to(dtype)
    weight = (1.0 + 0.5 * torch.randn(hidden, device=device)).to(dtype)
    return x, residual, weight


def nans(num_tokens: int, hidden: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.full((num_tokens, hidden), float("nan"), dtype=dtype, device=device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", HIDDEN_SIZES)
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
def test_with_residual_matches_reference(
    device: torch.device, dtype: torch.dtype, hidden: int, num_tokens: int
) -> None:
    torch.manual_seed(num_tokens * 1000 + hidden)
    x, residual, weight = random_inputs(num_tokens, hidden, dtype, device)
    out = nans(num_tokens, hidden, dtype, device)
    residual_out = nans(num_tokens, hidden, dtype, device)
    got, got_residual = rms_norm(x, weight, EPS, residual, out=out, residual_out=residual_out)
    want, want_residual = rms_norm_ref(x, weight, EPS, residual)
    assert got is out and got_residual is residual_out
    # The add is one rounding of the same fp32 sum on both sides: bit-exact.
    torch.testing.assert_close(got_residual, want_residual, atol=0, rtol=0)
    assert_matches(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", HIDDEN_SIZES)
@pytest.mark.parametrize("num_tokens", [1, 33])
def test_without_residual_returns_x(
    device: torch.device, dtype: torch.dtype, hidden: int, num_tokens: int
) -> None:
    torch.manual_seed(num_tokens + hidden)
    x, _, weight = random_inputs(num_tokens, hidden, dtype, device)
    out = nans(num_tokens, hidden, dtype, device)
    got, got_residual = rms_norm(x, weight, EPS, out=out)
    assert got_residual is x, "without a residual, the reference returns x itself"
    assert_matches(got, rms_norm_ref(x, weight, EPS)[0])


def test_allocates_contiguous_outputs_by_default(device: torch.device) -> None:
    torch.manual_seed(1)
    x, residual, weight = random_inputs(5, 96, torch.float32, device)
    got, got_residual = rms_norm(x, weight, EPS, residual)
    want, want_residual = rms_norm_ref(x, weight, EPS, residual)
    assert got.is_contiguous() and got_residual.is_contiguous()
    assert got_residual.data_ptr() not in (x.data_ptr(), residual.data_ptr())
    torch.testing.assert_close(got_residual, want_residual, atol=0, rtol=0)
    assert_matches(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_residual_updated_in_place(device: torch.device, dtype: torch.dtype) -> None:
    torch.manual_seed(2)
    x, residual, weight = random_inputs(9, 96, dtype, device)
    want, want_residual = rms_norm_ref(x, weight, EPS, residual)
    got, got_residual = rms_norm(x, weight, EPS, residual, residual_out=residual)
    assert got_residual is residual
    torch.testing.assert_close(residual, want_residual, atol=0, rtol=0)
    assert_matches(got, want)


def test_strided_rows(device: torch.device) -> None:
    """Rows of x, residual and the outputs may be slices of wider buffers."""
    torch.manual_seed(3)
    num_tokens, hidden = 6, 96
    wide = torch.randn(num_tokens, 3 * hidden, device=device)
    x, residual = wide[:, :hidden], wide[:, 2 * hidden :]
    weight = torch.randn(hidden, device=device)
    outs = nans(num_tokens, 2 * hidden, torch.float32, device)
    out, residual_out = outs[:, :hidden], outs[:, hidden:]
    want, want_residual = rms_norm_ref(x, weight, EPS, residual)
    rms_norm(x, weight, EPS, residual, out=out, residual_out=residual_out)
    torch.testing.assert_close(residual_out, want_residual, atol=0, rtol=0)
    assert_matches(out, want)


def test_rejects_bad_inputs(device: torch.device) -> None:
    x = torch.randn(4, 96, device=device)
    weight = torch.randn(96, device=device)
    with pytest.raises(AssertionError, match="contiguous last dim"):
        rms_norm(torch.randn(96, 4, device=device).t(), weight, EPS)
    with pytest.raises(AssertionError, match="cast it"):
        rms_norm(x, weight.half(), EPS)
    with pytest.raises(AssertionError, match="weight is"):
        rms_norm(x, weight[:64], EPS)
    with pytest.raises(AssertionError, match="residual has shape"):
        rms_norm(x, weight, EPS, torch.randn(3, 96, device=device))
    with pytest.raises(AssertionError, match="residual_out needs residual"):
        rms_norm(x, weight, EPS, residual_out=torch.empty_like(x))


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("num_tokens", [1, 17, 256, 8192])
def test_llama3_8b_shapes(num_tokens: int) -> None:
    """bf16 at hidden 4096: the residual bit-exact; normalised values within 1 ulp.

    With weight = 1, `out` is the normalised row itself, which may differ only by the rounding
    of a slightly different fp32 rstd: 1 ulp. A random weight scales that 1-ulp difference by
    its mantissa (up to 2x) before the product is rounded again: 2 ulps.
    """
    torch.manual_seed(num_tokens)
    device = torch.device("cuda")
    x, residual, weight = random_inputs(num_tokens, 4096, torch.bfloat16, device)
    ones = torch.ones_like(weight)
    got, got_residual = rms_norm(x, ones, 1e-5, residual)
    want, want_residual = rms_norm_ref(x, ones, 1e-5, residual)
    torch.testing.assert_close(got_residual, want_residual, atol=0, rtol=0)
    assert_matches(got, want, max_ulps=1)
    got, _ = rms_norm(x, weight, 1e-5, residual)
    assert_matches(got, rms_norm_ref(x, weight, 1e-5, residual)[0], max_ulps=2)


@pytest.mark.gpu
@requires_gpu
def test_cuda_graph_capture() -> None:
    device = torch.device("cuda")
    x, residual, weight = random_inputs(64, 4096, torch.bfloat16, device)
    rms_norm(x, weight, 1e-5, residual)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, residual_out = rms_norm(x, weight, 1e-5, residual)
    new_x, new_residual, _ = random_inputs(64, 4096, torch.bfloat16, device)
    x.copy_(new_x)
    residual.copy_(new_residual)
    graph.replay()
    torch.cuda.synchronize()
    want, want_residual = rms_norm_ref(new_x, weight, 1e-5, new_residual)
    torch.testing.assert_close(residual_out, want_residual, atol=0, rtol=0)
    assert_matches(out, want)
