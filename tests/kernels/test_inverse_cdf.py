"""The inverse-CDF kernels draw the tokens of their torch reference, which is the CPU's sampling
path: from weights exactly (the sums are fixed-point integers, so the answer cannot depend on
their order); from tempered logits, where the kernel's exponential may differ from torch's in
the last bit, the same tokens but where a draw falls within a hair of a token's edge."""

from __future__ import annotations

import pytest
import torch

from metrale.kernels.inverse_cdf import inverse_cdf, tempered_inverse_cdf
from metrale.runner.inverse_cdf import PROB_SCALE, inverse_cdf_torch, tempered_weights


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


def check_tempered(logits: torch.Tensor, temperature: torch.Tensor, d: torch.Tensor) -> None:
    """The kernel's tokens against the torch formula's: equal, or (an exponential a bit off) a
    neighbour where the draw lies within 1e-6 of the row's total from their shared edge."""
    got = tempered_inverse_cdf(logits, temperature, d).cpu()
    weights = tempered_weights(logits.cpu().float(), temperature.cpu())
    expected = inverse_cdf_torch(weights, d.cpu())
    counts = (weights * PROB_SCALE).to(torch.int64).cumsum(dim=-1)
    for row in torch.nonzero(got != expected).flatten().tolist():
        edge = counts[row, min(got[row], expected[row])]
        target = d[row].item() * counts[row, -1].item()
        assert abs(edge - target) < 1e-6 * counts[row, -1], (row, got[row], expected[row])
    assert (got == expected).float().mean() > 0.9


@pytest.mark.parametrize("vocab_size", [7, 4096, 9000])
def test_tempered_matches_the_torch_formula(device: torch.device, vocab_size: int) -> None:
    torch.manual_seed(vocab_size)
    logits = torch.randn(12, vocab_size) * 3
    logits[1, ::2] = float("-inf")  # banned or masked tokens
    logits[2, -1] = 50.0  # one token takes (nearly) everything
    temperature = torch.tensor([1.0, 0.6, 2.0, 0.05, 1.3, 1.0] * 2)
    d = torch.rand(12, dtype=torch.float64)
    d[0], d[1] = 0.0, 1.0 - 2.0**-53
    check_tempered(logits.to(device), temperature.to(device), d.to(device))
    bf16 = logits.to(torch.bfloat16)  # the lm head's own dtype: read as it is
    check_tempered(bf16.to(device), temperature.to(device), d.to(device))
    ids = tempered_inverse_cdf(logits.to(device), temperature.to(device), d.to(device)).cpu()
    assert (ids[1] % 2 == 1).item() and ids[2] == vocab_size - 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("num_rows", [1, 256])
def test_tempered_matches_the_torch_formula_at_a_real_vocabulary(num_rows: int) -> None:
    torch.manual_seed(num_rows)
    logits = (torch.randn(num_rows, 151_936) * 4).to(torch.bfloat16).cuda()
    temperature = (torch.rand(num_rows) + 0.3).cuda()
    check_tempered(logits, temperature, torch.rand(num_rows, dtype=torch.float64).cuda())
