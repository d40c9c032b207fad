"""`prefetch_to_l2`: only ever a hint. Where it is on, and on which weights."""

from __future__ import annotations

import pytest
import torch

from metrale import envs
from metrale.kernels.l2_prefetch import CHUNK_BYTES, can_prefetch, prefetch_to_l2

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def test_off_unless_asked_and_never_for_a_missing_or_host_weight(monkeypatch) -> None:
    monkeypatch.delenv("METRALE_L2_PREFETCH", raising=False)
    assert not envs.l2_prefetch()
    monkeypatch.setenv("METRALE_L2_PREFETCH", "1")
    assert envs.l2_prefetch()
    assert not can_prefetch(None)
    weight = torch.ones(1024, 1024)
    assert not can_prefetch(weight)  # on the host
    prefetch_to_l2(weight)  # which it leaves alone
    assert torch.equal(weight, torch.ones(1024, 1024))


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper-or-later GPU")
def test_the_prefetch_runs_in_a_graph_and_changes_nothing() -> None:
    w = torch.randn(4096, 4096 + 8, device="cuda", dtype=torch.bfloat16)  # a ragged last chunk
    assert can_prefetch(w) and w.numel() * 2 % CHUNK_BYTES
    before = w.clone()
    x = torch.randn(1, w.shape[1], device="cuda", dtype=torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    prefetch_to_l2(w)  # compiled outside the capture
    with torch.cuda.graph(graph):
        prefetch_to_l2(w)
        y = x @ w.t()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(w, before)
    torch.testing.assert_close(y, x @ w.t())
