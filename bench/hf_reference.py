"""What the benchmarks' transformers references share."""

from __future__ import annotations

import torch


def left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch for `generate`: token ids [batch, longest] padded with 0 on the left, as
    decoder-only generation needs, and the attention mask that hides the padding."""
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, prompt in enumerate(prompts):
        ids[i, width - len(prompt) :] = torch.tensor(prompt)
        mask[i, width - len(prompt) :] = 1
    return ids, mask
