"""Steps that startup runs before any request holds a block: to size the KV pool, and to time
prefills and decodes (with and without drafts) for the scheduler's cost models."""

from __future__ import annotations

from metrale.engine.step import ScheduledChunk, SchedulerOutput
from metrale.sampling_params import SamplingParams


def prefill_probe(num_tokens: int, block_size: int) -> SchedulerOutput:
    """A step that prefills `num_tokens` tokens into the pool's first blocks and samples once:
    what startup times and profiles, before any request holds a block."""
    chunk = ScheduledChunk(
        "probe",
        [0] * num_tokens,
        0,
        list(range(-(-num_tokens // block_size))),
        True,
        SamplingParams(temperature=0.0),
    )
    return SchedulerOutput([chunk])


def decode_probe(
    num_seqs: int, num_drafts: int, context_len: int, block_size: int, num_blocks: int
) -> SchedulerOutput:
    """A decode step of `num_seqs` sequences at `context_len` tokens (fewer where the pool is
    small), each checking `num_drafts` drafts; the sequences share the pool's first blocks: what
    startup times, before any request holds a block."""
    context_len = min(context_len, num_blocks * block_size - 1 - num_drafts)
    block_ids = list(range(-(-(context_len + 1 + num_drafts) // block_size)))
    drafts = (0,) * num_drafts
    chunks = [
        ScheduledChunk(
            f"probe-{i}",
            [0, *drafts],
            context_len,
            block_ids,
            True,
            SamplingParams(temperature=0.0),
            draft_token_ids=drafts,
        )
        for i in range(num_seqs)
    ]
    return SchedulerOutput(chunks, has_drafts=num_drafts > 0)
