"""The GPU code path (triton attention backend, fused kernels, `gemv` decode steps) run on CPU in
Triton's interpreter gives the torch backend's tokens, through chunked prefill and preemption:
CI has no GPU. Slow, so few tokens.

On a GPU machine this file skips and tests/gpu/test_engine_on_gpu.py runs the same comparison on
the device: one case of it in the default `pytest`, which deselects `gpu`
(`test_triton_backend_matches_the_cpu_reference[llama-cuda-graphs-auto]`), every case (graphs,
fp8, bf16 against transformers) under `pytest -m gpu`."""

from __future__ import annotations

import pytest
import torch

from metrale import LLM, SamplingParams
from tests.conftest import build_checkpoint

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="on a GPU machine tests/gpu/test_engine_on_gpu.py runs this path on the device "
    "(its [llama-cuda-graphs-auto] case in the default run)",
)
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_triton_backend_gives_the_torch_backends_tokens(tmp_path, arch) -> None:
    model_dir = build_checkpoint(tmp_path, arch)
    g = torch.Generator().manual_seed(3)
    batch = [torch.randint(10, 4000, (n,), generator=g).tolist() for n in (5, 17, 40, 33, 64, 1)]
    reference = LLM(model_from_path=str(model_dir), dtype="float32", device="cpu")
    expected = reference.generate(batch, PARAMS, use_tqdm=False)
    llm = LLM(
        model_from_path=str(model_dir),
        dtype="float32",
        device="cpu",
        attention_backend="triton",
        enforce_eager=True,
        max_prefill_tokens=24,  # prompts in chunks
        num_kv_blocks=12,  # too few for all six: some are preempted and recomputed
    )
    steps = []  # (decode rows leading the step, longest chunk) of each step
    build = llm.engine.runner.build_metadata

    def recording_build(step):
        steps.append((step.num_decode_seqs, step.max_query_len))
        return build(step)

    llm.engine.runner.build_metadata = recording_build
    outputs = llm.generate(batch, PARAMS, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    # Mixed steps ran, their decode rows through the decode kernel.
    assert any(num_decodes > 0 and longest > 1 for num_decodes, longest in steps)
    for ours, ref in zip(outputs, expected, strict=True):
        a, b = ours.outputs[0], ref.outputs[0]
        assert a.token_ids == b.token_ids
        for step, token in enumerate(a.token_ids):
            assert abs(a.logprobs[step][token].logprob - b.logprobs[step][token].logprob) < 1e-4
