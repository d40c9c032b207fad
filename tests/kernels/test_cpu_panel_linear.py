"""The CPU product over panels of output columns (`kernels/cpu/panel_linear.cpp`): x @ W.T (+ bias)
equals a float64 product to float32 rounding at every row count its kernels and their row groups
split differently (one panel at a time up to one group of rows, several panels a pass past it, a
last partial group), at widths with a partial last panel inside a pass of several and alone, and
panel counts that several do not divide, on rows of any stride; the same bits on any number of
threads, which claim runs of panels as they come free; packing is exact and reversible; inputs it
cannot read are errors, not wrong numbers.
"""

from __future__ import annotations

import pytest
import torch

from metrale.kernels import cpu_extension
from tests.conftest import needs_cpu_kernels

pytestmark = needs_cpu_kernels


@pytest.fixture(autouse=True)
def built():
    assert cpu_extension.available()


def lanes() -> int:
    return torch.ops.metrale_cpu.panel_lanes()


def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ w.double().T
    return (out if bias is None else out + bias.double()).float()


@pytest.mark.parametrize("rows", [1, 2, 7, 12, 13, 16, 17, 24, 25, 40, 300])
@pytest.mark.parametrize("n, k", [(1000, 300), (59, 33), (48, 64), (8, 5), (3, 17)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_equals_the_product_to_float32_rounding(rows, n, k, with_bias) -> None:
    torch.manual_seed(rows * 1000 + n + k)
    w = torch.randn(n, k)
    x = torch.randn(rows, k)
    bias = torch.randn(n) if with_bias else None
    panels = cpu_extension.pack_panels(w)
    out = cpu_extension.panel_linear(x, panels, bias, n)
    assert out.shape == (rows, n) and out.dtype == torch.float32
    # sums of k products of unit normals: float32 rounding grows with sqrt(k) * |terms|
    torch.testing.assert_close(out, reference(x, w, bias), rtol=1e-5, atol=2e-5 * k**0.5)


@pytest.mark.parametrize("rows", [3, 16, 40])
def test_any_number_of_threads_gives_the_same_bits(rows, torch_threads) -> None:
    # 63 panels (or 16 passes of several) claimed in runs: a panel skipped, or two threads'
    # runs overlapping on a pass, shows here, and each column's sum does not depend on who ran it
    torch.manual_seed(rows)
    w, x, bias = torch.randn(1000, 96), torch.randn(rows, 96), torch.randn(1000)
    panels = cpu_extension.pack_panels(w)
    outs = []
    for threads in (1, 2, 3, 5):
        torch_threads(threads)
        outs.append(cpu_extension.panel_linear(x, panels, bias, 1000))
    torch.testing.assert_close(outs[0], reference(x, w, bias), rtol=1e-5, atol=2e-4)
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


def test_panels_hold_the_weight_by_columns_and_zero_padding() -> None:
    w = torch.arange(21 * 5, dtype=torch.float32).view(21, 5)
    panels = cpu_extension.pack_panels(w)
    width = lanes()
    count = -(-21 // width)
    assert panels.shape == (count, 5, width)
    dense = panels.transpose(1, 2).reshape(count * width, 5)
    assert torch.equal(dense[:21], w)
    assert not dense[21:].any()


@pytest.mark.parametrize("rows", [6, 20])  # one group (read interleaved), several (as they lie)
@pytest.mark.parametrize("view", ["every other column", "the first columns of wider rows"])
def test_rows_of_any_stride(rows, view) -> None:
    w = torch.randn(40, 32)
    wide = torch.randn(rows, 64)
    x = wide[:, ::2] if view == "every other column" else wide[:, :32]
    out = cpu_extension.panel_linear(x, cpu_extension.pack_panels(w), None, 40)
    torch.testing.assert_close(out, reference(x, w, None), rtol=1e-5, atol=1e-4)


def test_no_rows_give_an_empty_product() -> None:
    w = torch.randn(40, 32)
    out = cpu_extension.panel_linear(torch.empty(0, 32), cpu_extension.pack_panels(w), None, 40)
    assert out.shape == (0, 40)


def test_inputs_it_cannot_read_are_errors() -> None:
    w = torch.randn(40, 32)
    panels = cpu_extension.pack_panels(w)
    with pytest.raises(RuntimeError, match="x must be float32"):
        cpu_extension.panel_linear(torch.randn(2, 32, dtype=torch.bfloat16), panels, None, 40)
    with pytest.raises(RuntimeError, match="panels must be"):
        cpu_extension.panel_linear(torch.randn(2, 31), panels, None, 40)
    with pytest.raises(RuntimeError, match="is not in"):
        cpu_extension.panel_linear(torch.randn(2, 32), panels, None, 400)
    with pytest.raises(RuntimeError, match="bias must be"):
        cpu_extension.panel_linear(torch.randn(2, 32), panels, torch.randn(39), 40)
