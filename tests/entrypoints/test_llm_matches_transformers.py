"""Greedy tokens identical to Hugging Face transformers, logprobs within 1e-3 (fp32).

The reference is transformers' own `generate` on the same checkpoint, one prompt at a time (no
padding on the reference side). Our engine runs the prompts batched together, and again with
chunked prefill, with a KV pool so small that requests are preempted and recomputed, and with
shared prefixes served from the prefix cache.
"""

from __future__ import annotations

import pytest
import torch

from metrale import LLM, SamplingParams
from metrale.layers.attention import to_cache_dtype
from tests.conftest import build_checkpoint
from tests.fidelity import NEAR_TIE, assert_greedy_match, hf_greedy

MAX_NEW_TOKENS = 24
LOGPROB_TOL = 1e-3


def prompts_of(lengths, seed=0, vocab=4000, prefix=None):
    g = torch.Generator().manual_seed(seed)
    prefix = prefix or []
    return [prefix + torch.randint(10, vocab, (n,), generator=g).tolist() for n in lengths]


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True, logprobs=5)
LENGTHS = (5, 17, 40, 33, 64, 1)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def case(request, tmp_path_factory):
    model_dir = build_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    prompts = prompts_of(LENGTHS)
    return model_dir, prompts, hf_greedy(model_dir, prompts, MAX_NEW_TOKENS)


def check(outputs, refs, what, logprob_tol=LOGPROB_TOL):
    for i, (out, ref) in enumerate(zip(outputs, refs, strict=True)):
        completion = out.outputs[0]
        compared = assert_greedy_match(completion.token_ids, ref, f"{what} prompt {i}")
        for step in range(compared):
            token = completion.token_ids[step]
            ours = completion.logprobs[step]
            assert abs(ours[token].logprob - float(ref.logprobs[step][token])) < logprob_tol
            ref_top = ref.logprobs[step].topk(5)
            ours_top = sorted(
                (
                    (lp.rank, t, lp.logprob)
                    for t, lp in ours.items()
                    if lp.rank is not None and lp.rank <= 5
                )
            )
            assert [t for _, t, _ in ours_top][:5] == ref_top.indices.tolist() or ref_top.values[
                4
            ] - ref.logprobs[step].topk(6).values[5] < NEAR_TIE
            for (_, _, lp), ref_lp in zip(ours_top, ref_top.values.tolist(), strict=False):
                assert abs(lp - ref_lp) < logprob_tol


# Async scheduling feeds each decode the token sampled by the step before, on the device.
SCHEDULING = pytest.mark.parametrize("scheduling", ["sync", "async"])


@SCHEDULING
def test_batched(case, scheduling):
    model_dir, prompts, refs = case
    llm = LLM(model_from_path=str(model_dir), dtype="float32", scheduler_config=scheduling)
    check(llm.generate(prompts, GREEDY, use_tqdm=False), refs, "batched")


@SCHEDULING
def test_chunked_prefill(case, scheduling):
    model_dir, prompts, refs = case
    llm = LLM(
        model_from_path=str(model_dir),
        dtype="float32",
        max_prefill_tokens=7,
        scheduler_config=scheduling,
    )
    check(llm.generate(prompts, GREEDY, use_tqdm=False), refs, "chunked prefill")


@SCHEDULING
def test_preemption(case, scheduling):
    model_dir, prompts, refs = case
    # The longest request needs 64 + 24 tokens = 6 blocks; 12 blocks cannot hold all six.
    llm = LLM(
        model_from_path=str(model_dir),
        dtype="float32",
        num_kv_blocks=12,
        scheduler_config=scheduling,
    )
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0, "the tiny pool must force preemption"
    check(outputs, refs, "preemption")
    assert llm.engine.scheduler.kv_cache.pool.num_used_blocks == 0


@SCHEDULING
@pytest.mark.parametrize("max_prefill_tokens", [None, 7], ids=["whole", "chunked"])
@pytest.mark.parametrize("prefix_caching", [True, False], ids=["cached", "uncached"])
def test_swap_to_host(case, scheduling, max_prefill_tokens, prefix_caching):
    """Preempted requests' blocks go to the host pool and back instead of being recomputed
    (those still cached on the device are taken as they are): the same greedy tokens and
    logprobs as transformers, nothing recomputed, every block (device and host) free at the
    end."""
    model_dir, prompts, refs = case
    llm = LLM(
        model_from_path=str(model_dir),
        dtype="float32",
        num_kv_blocks=8,
        enable_prefix_caching=prefix_caching,
        swap_space_gb=0.01,
        preemption_mode="swap",
        max_prefill_tokens=max_prefill_tokens,
        scheduler_config=scheduling,
    )
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    scheduler = llm.engine.scheduler
    assert scheduler.swap.num_swap_outs > 0 and scheduler.swap.blocks_in > 0
    assert scheduler.num_recomputed_tokens == 0
    check(outputs, refs, "swap")
    assert scheduler.kv_cache.pool.num_used_blocks == 0
    assert scheduler.swap.num_free_blocks == scheduler.swap.num_blocks


@SCHEDULING
@pytest.mark.parametrize("preemption_mode", ["swap", "recompute"])
def test_seeded_sampling_is_the_same_under_a_preemption_storm(case, scheduling, preemption_mode):
    """A request's seeded draws, penalties' history and everything else it carries survive
    being swapped out and back (or recomputed): each request samples what it samples alone."""
    model_dir, prompts, _ = case
    params = [
        SamplingParams(
            temperature=0.9,
            top_p=0.95,
            max_tokens=MAX_NEW_TOKENS,
            ignore_eos=True,
            seed=100 + i,
            frequency_penalty=0.3 if i % 2 else 0.0,
        )
        for i in range(len(prompts))
    ]

    def generate(**pool):
        llm = LLM(
            model_from_path=str(model_dir), dtype="float32", scheduler_config=scheduling, **pool
        )
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outputs], llm.engine.scheduler

    alone, _ = generate()
    stormed, scheduler = generate(
        num_kv_blocks=8, swap_space_gb=0.01, preemption_mode=preemption_mode
    )
    assert scheduler.num_preemptions > 0
    assert (scheduler.swap.num_swap_outs > 0) == (preemption_mode == "swap")
    assert stormed == alone


def test_shared_prefixes_hit_the_cache(case, tmp_path):
    model_dir, _, _ = case
    prefix = prompts_of([40], seed=7)[0]
    prompts = prompts_of((3, 9, 20), seed=8, prefix=prefix)
    refs = hf_greedy(model_dir, prompts, MAX_NEW_TOKENS)
    llm = LLM(model_from_path=str(model_dir), dtype="float32")
    first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    rest = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
    check(first + rest, refs, "prefix cache")
    assert first[0].num_cached_tokens == 0
    # The 40-token shared prefix covers two whole 16-token blocks.
    assert [o.num_cached_tokens for o in rest] == [32, 32]
    assert llm.engine.scheduler.kv_cache.stats.num_hit_tokens == 64


def sdpa_over_fp8_kv(module, query, key, value, *args, **kwargs):
    """transformers' SDPA over keys and values rounded as an fp8 KV cache holds them."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def rounded(x):
        return to_cache_dtype(x, torch.float8_e4m3fn).to(x.dtype)

    return sdpa_attention_forward(module, query, rounded(key), rounded(value), *args, **kwargs)


@SCHEDULING
def test_fp8_kv_cache(case, scheduling):
    """With --kv-cache-dtype fp8 the engine computes what transformers computes over fp8-rounded
    keys and values: same greedy tokens, logprobs within 1e-2 (a key within float error of an
    fp8 rounding boundary may round the other way), through chunked prefill and a full pool."""
    from transformers import AttentionInterface

    model_dir, prompts, refs = case
    AttentionInterface.register("sdpa_over_fp8_kv", sdpa_over_fp8_kv)
    fp8_refs = hf_greedy(model_dir, prompts, MAX_NEW_TOKENS, attn_implementation="sdpa_over_fp8_kv")
    llm = LLM(
        model_from_path=str(model_dir),
        dtype="float32",
        kv_cache_dtype="fp8",
        max_prefill_tokens=7,
        num_kv_blocks=12,
        scheduler_config=scheduling,
    )
    assert llm.engine.runner.kv_caches[0][0].dtype == torch.float8_e4m3fn
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    check(outputs, fp8_refs, "fp8 KV cache", logprob_tol=1e-2)
    # The rounding is real: against the unrounded reference the engine is further off.
    first = [(out.outputs[0].logprobs[0], ref) for out, ref in zip(outputs, refs, strict=True)]
    worst = max(
        abs(lps[r.token_ids[0]].logprob - float(r.logprobs[0][r.token_ids[0]])) for lps, r in first
    )
    assert worst > 1e-2


@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_other_families(arch, tmp_path):
    model_dir = build_checkpoint(tmp_path, arch)
    prompts = prompts_of((6, 30))
    refs = hf_greedy(model_dir, prompts, MAX_NEW_TOKENS)
    llm = LLM(model_from_path=str(model_dir), dtype="float32", max_prefill_tokens=16)
    check(llm.generate(prompts, GREEDY, use_tqdm=False), refs, arch)


def test_llama3_rope_scaling_and_tied_embeddings(tmp_path):
    rope = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
        "rope_theta": 5e5,
    }
    model_dir = build_checkpoint(tmp_path, "llama", rope_parameters=rope, tie_word_embeddings=True)
    prompts = prompts_of((12, 50))
    refs = hf_greedy(model_dir, prompts, MAX_NEW_TOKENS)
    llm = LLM(model_from_path=str(model_dir), dtype="float32")
    model = llm.engine.runner.model
    assert "lm_head.weight" not in dict(model.named_parameters())  # the embedding's, shared
    check(llm.generate(prompts, GREEDY, use_tqdm=False), refs, "llama3 rope")


def test_bfloat16_stays_close(tmp_path):
    model_dir = build_checkpoint(tmp_path, "qwen3", dtype=torch.bfloat16)
    prompts = prompts_of((8, 21))
    refs = hf_greedy(model_dir, prompts, MAX_NEW_TOKENS, dtype=torch.bfloat16)
    llm = LLM(model_from_path=str(model_dir))
    assert llm.config.dtype is torch.bfloat16
    for out, ref in zip(llm.generate(prompts, GREEDY, use_tqdm=False), refs, strict=True):
        completion = out.outputs[0]
        # bf16 keeps 8 bits of mantissa: compare the first token exactly and the first
        # position's logprob loosely; later tokens may diverge on legitimate bf16 ties.
        assert completion.token_ids[0] == ref.token_ids[0]
        token = ref.token_ids[0]
        assert abs(completion.logprobs[0][token].logprob - float(ref.logprobs[0][token])) < 0.1


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_attention_bias_reaches_every_projection(arch, tmp_path):
    """`attention_bias`: Llama and Qwen3 bias q, k, v and o (Qwen2 biases q, k, v only);
    each bias is loaded and added once, at every tensor-parallel size's one-rank layout."""
    model_dir = build_checkpoint(tmp_path, arch, attention_bias=True)
    prompts = prompts_of((9, 35))
    refs = hf_greedy(model_dir, prompts, MAX_NEW_TOKENS)
    llm = LLM(model_from_path=str(model_dir), dtype="float32")
    attention = llm.engine.runner.model.model.layers[0].self_attn
    assert attention.qkv_proj.bias is not None and attention.o_proj.bias is not None
    check(llm.generate(prompts, GREEDY, use_tqdm=False), refs, f"{arch} attention_bias")
