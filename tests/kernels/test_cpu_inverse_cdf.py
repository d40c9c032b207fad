"""The CPU op that draws a sampled row's token from its logits (`kernels/cpu/inverse_cdf.cpp`):
the same tokens as the torch formula it stands for (`runner/inverse_cdf.py`'s `tempered_weights`
then `inverse_cdf_torch`), over vocabularies that do and do not fill its vectors, masked tokens,
a token that takes nearly everything, and draws at both ends of [0, 1); bad inputs are errors.
"""

from __future__ import annotations

import pytest
import torch

from metrale.kernels import cpu_extension
from metrale.runner.inverse_cdf import inverse_cdf_torch, tempered_inverse_cdf, tempered_weights
from tests.conftest import needs_cpu_kernels

pytestmark = needs_cpu_kernels


@pytest.fixture(autouse=True)
def built():
    assert cpu_extension.available()


@pytest.mark.parametrize("vocab_size", [1, 7, 16, 100, 4099, 49_152])
def test_draws_the_torch_formulas_tokens(vocab_size: int) -> None:
    torch.manual_seed(vocab_size)
    rows = 64
    logits = torch.randn(rows, vocab_size) * 4
    logits[1, ::2] = float("-inf")  # banned or grammar-masked tokens
    logits[2, -1] = 60.0  # one token takes (nearly) everything
    temperature = torch.rand(rows) * 1.5 + 0.05
    draws = torch.rand(rows, 3, dtype=torch.float64)[:, 0]  # a column, as the sampler passes
    draws[0], draws[3] = 0.0, 1.0 - 2.0**-53
    got = torch.ops.metrale_cpu.tempered_inverse_cdf(logits, temperature, draws)
    expected = inverse_cdf_torch(tempered_weights(logits, temperature), draws)
    assert torch.equal(got, expected)
    assert torch.equal(tempered_inverse_cdf(logits, temperature, draws), expected)  # the route
    if vocab_size > 2:
        assert got[1] % 2 == 1 and got[2] == vocab_size - 1


def test_garbage_logits_still_give_token_ids() -> None:
    logits = torch.randn(4, 300)
    logits[0, 5] = float("nan")
    logits[1] = float("nan")
    logits[2] = float("-inf")
    ids = torch.ops.metrale_cpu.tempered_inverse_cdf(
        logits, torch.ones(4), torch.rand(4, dtype=torch.float64)
    )
    assert ((ids >= 0) & (ids < 300)).all()


@pytest.mark.parametrize(
    ("logits", "temperature", "draws", "message"),
    [
        (torch.randn(2, 8).double(), torch.ones(2), torch.rand(2).double(), "logits"),
        (torch.randn(2, 8), torch.ones(3), torch.rand(2).double(), "temperature"),
        (torch.randn(2, 8), torch.ones(2), torch.rand(2), "draws"),
    ],
)
def test_bad_inputs_are_errors(logits, temperature, draws, message) -> None:
    with pytest.raises(RuntimeError, match=message):
        torch.ops.metrale_cpu.tempered_inverse_cdf(logits, temperature, draws)
