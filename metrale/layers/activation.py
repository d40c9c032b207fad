"""SiLU-and-mul, the gated MLP activation of Llama-family models."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from metrale.kernels import cpu_extension


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    # [num_tokens, 2 * intermediate] -> [num_tokens, intermediate]
    if cpu_extension.takes(gate_up):  # one pass, not two (and a strided gate)
        return cpu_extension.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
