"""The CPU kernel of one-row products over packed GGUF weights (`kernels/cpu_extension.py`): built
with g++ on first use, it equals the float32 product over the dequantized weight for every format,
at shapes whose blocks do and do not fill its four-block turns and whose rows do and do not fill a
thread's share, with the same bits on any number of threads; wrong inputs are errors, not wrong
numbers; where it cannot be built the module says so instead of raising.
"""

from __future__ import annotations

import pytest
import torch

from metrale.kernels import cpu_extension
from metrale.kernels.quant_layout import FORMAT_IDS, FORMATS, matmul_ref, random_packed
from tests.conftest import needs_cpu_kernels


@needs_cpu_kernels
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n, k", [(1, 32), (5, 96), (130, 160), (257, 576), (64, 1536)])
def test_equals_the_product_over_the_dequantized_weight(fmt, n, k):
    assert cpu_extension.available()
    parts = random_packed(fmt, n, k, "cpu", seed=n + k)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(k))
    got = cpu_extension.packed_gemv(x, fmt, *parts)
    expected = matmul_ref(x, fmt, *parts, None, torch.float32)
    assert got.shape == (1, n) and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@needs_cpu_kernels
@pytest.mark.parametrize("fmt", FORMATS)
def test_any_number_of_threads_gives_the_same_bits(fmt, torch_threads):
    parts = random_packed(fmt, 1000, 256, "cpu", seed=3)  # 16 runs of 64 rows to claim
    x = torch.randn(1, 256)
    outs = []
    for threads in (1, 2, 3, 5):
        torch_threads(threads)
        outs.append(cpu_extension.packed_gemv(x, fmt, *parts))
    assert all(torch.equal(out, outs[0]) for out in outs[1:])


@needs_cpu_kernels
def test_a_non_contiguous_row_reads_as_its_values():
    parts = random_packed("Q4_1", 40, 64, "cpu")
    x = torch.randn(64, 2)[:, 0][None]  # a strided view
    expected = matmul_ref(x.contiguous(), "Q4_1", *parts, None, torch.float32)
    torch.testing.assert_close(cpu_extension.packed_gemv(x, "Q4_1", *parts), expected)


@needs_cpu_kernels
def test_inputs_that_do_not_fit_are_errors():
    q, s, m = random_packed("Q4_1", 8, 64, "cpu")
    op = torch.ops.metrale_cpu.packed_gemv
    assert cpu_extension.available()
    with pytest.raises(RuntimeError, match="columns"):
        op(torch.randn(1, 32), q, s, m, FORMAT_IDS["Q4_1"])
    with pytest.raises(RuntimeError, match=r"float32 \[1, K\]"):
        op(torch.randn(2, 64), q, s, m, FORMAT_IDS["Q4_1"])
    with pytest.raises(RuntimeError, match="qweight"):
        op(torch.randn(1, 64), q, s, m, FORMAT_IDS["Q8_0"])  # 4-bit bytes read as Q8_0
    with pytest.raises(RuntimeError, match="mins"):
        op(torch.randn(1, 64), q, s, s.new_empty(0), FORMAT_IDS["Q4_1"])
    with pytest.raises(RuntimeError, match="unknown format"):
        op(torch.randn(1, 64), q, s, m, 7)


def test_a_failed_build_is_reported_not_raised(monkeypatch, caplog):
    def no_compiler(*args, **kwargs):
        raise RuntimeError("Error building extension: g++: not found")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", no_compiler)
    cpu_extension.available.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="metrale.kernels.cpu_extension"):
            assert not cpu_extension.available()
        assert "could not build Metrale's CPU kernels" in caplog.text
    finally:
        cpu_extension.available.cache_clear()
