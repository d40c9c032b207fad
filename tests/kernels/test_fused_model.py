"""A model built with the fused Triton kernels computes what the torch-op model computes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from metrale.config import CacheConfig, ModelConfig, SchedulerConfig
from metrale.engine.step import ScheduledChunk, SchedulerOutput
from metrale.models import model_class_for
from metrale.runner.model_runner import ModelRunner
from metrale.sampling_params import SamplingParams
from tests.conftest import build_checkpoint


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fused_kernels_match_torch_ops(tmp_path, device, arch):
    model_config = ModelConfig.from_dir(build_checkpoint(tmp_path, arch))
    model_config = dataclasses.replace(model_config, max_position_embeddings=128)
    cls = model_class_for(model_config.architecture)
    cache = CacheConfig(
        block_size=16, num_blocks=8, enable_prefix_caching=False, dtype=torch.float32
    )
    scheduler = SchedulerConfig(
        max_num_seqs=4,
        max_batch_size=4,
        max_prefill_tokens=64,
        max_num_batched_tokens=64,
        max_seq_len=128,
    )
    torch.manual_seed(0)
    state = None
    results = []
    # The unfused model, then the fused one over the torch backend's attention and over the
    # triton backend's (paged kernels; rotary fused with the KV store).
    for fused, backend in ((False, "torch"), (True, "torch"), (True, "triton")):
        with torch.device(device):
            model = cls(model_config, fused_kernels=fused).eval()
        if state is None:
            for p in model.parameters():
                p.data.normal_(0, 0.15)
            state = model.state_dict()
        model.load_state_dict(state)
        runner = ModelRunner(
            model, model_config, cache, scheduler, torch.device(device), attention_backend=backend
        )
        params = SamplingParams(temperature=0, logprobs=3)
        chunks = [
            ScheduledChunk("a", list(range(10, 30)), 0, [0, 1], True, params),
            ScheduledChunk("b", list(range(40, 47)), 0, [2], True, params),
        ]
        # Then one row alone: the fused model's projections and head take `gemv`.
        decode = [ScheduledChunk("a", [77], 20, [0, 1], True, params)]
        results.append([runner.execute(SchedulerOutput(step)) for step in (chunks, decode)])
    unfused_steps = results[0]
    for fused_steps in results[1:]:
        for unfused, fused in zip(unfused_steps, fused_steps, strict=True):
            assert fused.sampled_token_ids == unfused.sampled_token_ids
            for a, b in zip(fused.logprobs, unfused.logprobs, strict=True):
                assert abs(a.logprob - b.logprob) < 1e-4
