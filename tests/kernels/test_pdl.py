"""Kernels launched with programmatic dependent launch compute what plain launches compute."""

from __future__ import annotations

import pytest
import torch

from metrale.kernels.gemv import gemv
from metrale.kernels.pdl import pdl_enabled
from metrale.kernels.rms_norm import rms_norm

ON_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def test_off_on_cpu_and_when_turned_off(monkeypatch) -> None:
    assert not pdl_enabled(torch.device("cpu"))
    monkeypatch.setenv("METRALE_PDL", "0")
    assert not pdl_enabled(torch.device("cuda", 0))


def _decoder_like_chain(x, residual, norms, ups, downs) -> torch.Tensor:
    """Each kernel reads what the one before it wrote; the residual is updated in place."""
    residual = residual.clone()
    for norm, up, down in zip(norms, ups, downs, strict=True):
        h, residual = rms_norm(x, norm, 1e-6, residual, residual_out=residual)
        x = gemv(gemv(h, up), down, silu_and_mul=True)
    return rms_norm(x, norms[0], 1e-6, residual)[0]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper or later GPU")
def test_a_cuda_graph_of_dependent_kernels_matches_plain_launches(monkeypatch) -> None:
    torch.manual_seed(0)
    hidden, inter, layers = 2048, 5632, 6
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    x = torch.randn(1, hidden, device=dev, dtype=bf16)
    residual = torch.randn(1, hidden, device=dev, dtype=bf16)
    norms = [torch.rand(hidden, device=dev, dtype=bf16) + 0.5 for _ in range(layers)]
    ups = [torch.randn(2 * inter, hidden, device=dev, dtype=bf16) * 0.02 for _ in range(layers)]
    downs = [torch.randn(hidden, inter, device=dev, dtype=bf16) * 0.02 for _ in range(layers)]
    args = (x, residual, norms, ups, downs)

    monkeypatch.setenv("METRALE_PDL", "0")
    expected = _decoder_like_chain(*args)
    monkeypatch.setenv("METRALE_PDL", "1")
    assert pdl_enabled(dev)
    assert torch.equal(_decoder_like_chain(*args), expected)  # eager launches

    _decoder_like_chain(*args)  # compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _decoder_like_chain(*args)
    for _ in range(20):
        out.zero_()
        graph.replay()
        assert torch.equal(out, expected)
