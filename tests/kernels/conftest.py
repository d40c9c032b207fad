"""Kernel tests run on the GPU when there is one, else in Triton's interpreter on small shapes.

TRITON_INTERPRET must be set before any kernel is defined, so it is set here, before the test
modules import `metrale.kernels`.
"""

from __future__ import annotations

import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if ON_GPU else "cpu")


@pytest.fixture
def torch_threads():
    """Sets torch's intra-op threads for the test (more than the cores, as well), and restores
    them after."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)
