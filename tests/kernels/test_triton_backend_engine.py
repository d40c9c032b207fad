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
from metrale.layers.linear import Linear
from tests.conftest import build_checkpoint
from tests.entrypoints.test_llm_speculation import repeating_model

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


def test_speculative_verify_through_the_decode_kernel(tmp_path) -> None:
    """A decode with drafts is laid out as one-row sequences, each seeing the context up to its
    own position: the triton decode kernel verifies them, and a model that repeats itself
    gives its reply, several tokens a step, with the logprobs of one token at a time."""
    model_path, prompt, reply = repeating_model(tmp_path)
    params = SamplingParams(temperature=0.0, max_tokens=len(reply) + 4, logprobs=1)
    reference = LLM(model_from_path=model_path, dtype="float32", device="cpu")
    expected = reference.generate([prompt], params, use_tqdm=False)
    llm = LLM(
        model_from_path=model_path,
        dtype="float32",
        device="cpu",
        attention_backend="triton",
        speculative_config="ngram",
        num_speculative_tokens=6,
        speculation_cost_model=False,
    )
    for layer in llm.engine.runner.model.modules():  # this checkpoint is wide: its products
        if isinstance(layer, Linear):  # in the interpreter's gemv would take minutes
            layer.fused = False
    steps = []  # (attention sequences, longest query) of each step
    build = llm.engine.runner.build_metadata

    def recording_build(step):
        steps.append((len(step.seq_lens), step.max_query_len))
        return build(step)

    llm.engine.runner.build_metadata = recording_build
    outputs = llm.generate([prompt], params, use_tqdm=False)
    assert llm.engine.scheduler.speculator.stats.num_accepted_tokens >= len(reply) // 2
    # Verify steps: more query rows than the one request, all through the decode kernel.
    assert any(rows > 1 and longest == 1 for rows, longest in steps)
    for ours, ref in zip(outputs, expected, strict=True):
        a, b = ours.outputs[0], ref.outputs[0]
        assert a.token_ids == b.token_ids == reply
        for step, token in enumerate(a.token_ids):
            assert abs(a.logprobs[step][token].logprob - b.logprobs[step][token].logprob) < 1e-4
