"""The engine on a GPU (triton kernels, CUDA graphs) agrees with the CPU reference path."""

from __future__ import annotations

import pytest
import torch

from metrale import LLM, SamplingParams
from tests.conftest import build_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PARAMS = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1)


def prompts(lengths: tuple[int, ...]) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(10, 4000, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "cuda-graphs"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_triton_backend_matches_the_cpu_reference(tmp_path, arch, eager, kv_cache_dtype):
    model_dir = build_checkpoint(tmp_path, arch)
    batch = prompts((5, 17, 40, 33, 64, 1))
    cpu = LLM(
        model_from_path=str(model_dir),
        dtype="float32",
        device="cpu",
        kv_cache_dtype=kv_cache_dtype,
    )
    reference = cpu.generate(batch, PARAMS, use_tqdm=False)
    gpu = LLM(
        model_from_path=str(model_dir),
        dtype="float32",
        device="cuda",
        enforce_eager=eager,
        max_prefill_tokens=24,
        num_kv_blocks=64,
        kv_cache_dtype=kv_cache_dtype,
    )
    # tf32 matmuls move a few keys across an fp8 rounding boundary: a looser bound there.
    tolerance = 2e-2 if kv_cache_dtype == "auto" else 6e-2
    assert gpu.engine.config.attention_backend == "triton"
    assert (gpu.engine.runner.graphs is None) == eager
    outputs = gpu.generate(batch, PARAMS, use_tqdm=False)
    for ours, ref in zip(outputs, reference, strict=True):
        a, b = ours.outputs[0], ref.outputs[0]
        # tf32 matmuls on the GPU: compare until the first near tie, logprobs loosely.
        for step, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=True)):
            lp_gpu, lp_cpu = a.logprobs[step][x].logprob, b.logprobs[step][y].logprob
            assert abs(lp_gpu - lp_cpu) < tolerance, (step, lp_gpu, lp_cpu)
            if x != y:
                break


def test_bfloat16_with_graphs_and_gpu_memory_sizing(tmp_path):
    model_dir = build_checkpoint(tmp_path, "qwen3")
    llm = LLM(
        model_from_path=str(model_dir),
        dtype="bfloat16",
        device="cuda",
        gpu_memory_utilization=0.5,
        max_seq_len=1024,
    )
    assert llm.engine.config.cache.num_blocks > 1000
    outputs = llm.generate(prompts((3, 100, 700)), PARAMS, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [16, 16, 16]
    assert llm.engine.scheduler.kv_cache.pool.num_used_blocks == 0
    from metrale.engine.stats import device_memory

    memory = device_memory(llm.engine)  # what /memory reports
    assert memory.total_bytes > memory.used_bytes >= memory.allocated_bytes > 0
    assert memory.budget_bytes == int(memory.total_bytes * 0.5)


def test_async_scheduling_gives_the_sync_tokens(tmp_path):
    """Same batches, same kernels: async must reproduce sync bit for bit, graphs and all."""
    model_dir = build_checkpoint(tmp_path, "qwen3")
    batch = prompts((5, 17, 40, 33, 64, 1, 300, 9))
    params = [
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=33, seed=7, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=25, min_tokens=3),
        SamplingParams(temperature=1.0, top_k=20, max_tokens=48, seed=1, ignore_eos=True),
    ] * 2
    runs = {}
    for scheduling in ("sync", "async"):
        llm = LLM(
            model_from_path=str(model_dir),
            dtype="bfloat16",
            device="cuda",
            max_prefill_tokens=64,
            num_kv_blocks=256,
            scheduler_config=scheduling,
        )
        assert llm.engine.config.async_scheduling == (scheduling == "async")
        runs[scheduling] = [
            (o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].logprobs)
            for o in llm.generate(batch, params, use_tqdm=False)
        ]
        assert llm.engine.scheduler.kv_cache.pool.num_used_blocks == 0
    assert runs["async"] == runs["sync"]
