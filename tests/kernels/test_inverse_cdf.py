"""The inverse-CDF kernel draws exactly the tokens of its torch reference, which is the CPU's
sampling path: the sums are fixed-point integers, so the answer cannot depend on their order."""

from __future__ import annotations

import pytest
import torch

from metrale.kernels.inverse_cdf import inverse_cdf
from metrale.runner.inverse_cdf import inverse_cdf_torch


def rows(num_rows: int, vocab_size: int, device: torch.device) -> torch.Tensor:
    """Assorted distributions: peaked, flat, with zero runs (min-p's masking), unnormalized,
    all zero, one-hot at the last token."""
    probs = torch.softmax(torch.randn(num_rows, vocab_size) * 4, dim=-1)
    probs[1] = 1.0 / vocab_size
    probs[2, ::3] = 0.0
    probs[3] *= 0.37
    probs[4] = 0.0
    probs[5] = 0.0
    probs[5, -1] = 1.0
    return probs.to(device)


def draws(num_rows: int, device: torch.device) -> torch.Tensor:
    d = torch.rand(num_rows, 3, dtype=torch.float64)
    d[0, 0], d[1, 0] = 0.0, 1.0 - 2.0**-53  # the ends of [0, 1)
    return d.to(device)[:, 0]  # a strided column, as the sampler passes it


@pytest.mark.parametrize("vocab_size", [7, 100, 4096, 5000, 9000])
def test_matches_the_torch_reference(device: torch.device, vocab_size: int) -> None:
    torch.manual_seed(vocab_size)
    probs, d = rows(9, vocab_size, device), draws(9, device)
    got = inverse_cdf(probs, d)
    assert torch.equal(got.cpu(), inverse_cdf_torch(probs.cpu(), d.cpu()))
    assert got[5] == vocab_size - 1  # all the mass on the last token
    zero = probs[2] == 0
    assert not zero[got[2]]  # a token of probability zero is never drawn


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("num_rows", [1, 256])
def test_matches_the_torch_reference_at_a_real_vocabulary(num_rows: int) -> None:
    torch.manual_seed(num_rows)
    device = torch.device("cuda")
    probs, d = rows(max(num_rows, 6), 151_936, device), draws(max(num_rows, 6), device)
    probs, d = probs[:num_rows], d[:num_rows]
    assert torch.equal(inverse_cdf(probs, d).cpu(), inverse_cdf_torch(probs.cpu(), d.cpu()))


@pytest.mark.filterwarnings("ignore:invalid value encountered in cast")  # the interpreter's numpy
def test_garbage_probabilities_still_give_token_ids(device: torch.device) -> None:
    """NaN or infinite probabilities (a broken model's logits) draw some token of the
    vocabulary, on either path, rather than an id past it."""
    torch.manual_seed(3)
    probs, d = rows(9, 5000, device), draws(9, device)
    probs[0, 7] = float("nan")
    probs[3] = float("nan")
    probs[6, 100] = float("inf")
    for ids in (inverse_cdf(probs, d).cpu(), inverse_cdf_torch(probs.cpu(), d.cpu())):
        assert ((ids >= 0) & (ids < 5000)).all(), ids
