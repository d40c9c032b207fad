"""The engine at two tensor-parallel ranks (CPU processes, gloo): rank 0 schedules and samples,
the other rank runs each step it is sent. Greedy tokens are the single-process engine's and
logprobs within 1e-4 (fp32), under batching, chunked prefill, preemption (recompute and swap),
prefix-cache hits and async scheduling; stopping ends the other rank; a rank killed under a
server turns /health red and fails requests within a second."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from metrale import LLM, SamplingParams
from tests.conftest import build_checkpoint
from tests.entrypoints.test_llm_matches_transformers import prompts_of
from tests.server.conftest import (
    MODEL_NAME,
    kill_and_expect_a_red_health,
    start_server,
    stop_server,
)

MAX_TOKENS = 24


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def case(request, tmp_path_factory):
    model_dir = build_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    shared = prompts_of([40], seed=3)[0]
    # Two pairs sharing a 40-token prefix (prefix hits), a long prompt (chunked prefill).
    prompts = [
        [*shared, 5, 6],
        [*shared, 7],
        *prompts_of([9, 70], seed=4),
        [*shared, 8, 9, 10],
    ]
    params = [
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1),
        SamplingParams(temperature=0.8, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
    ]
    single = LLM(model_from_path=str(model_dir), dtype="float32")
    reference = single.generate(prompts, params, use_tqdm=False)
    return model_dir, prompts, params, reference


def assert_same_outputs(ours, reference, params):
    for out, ref, p in zip(ours, reference, params, strict=True):
        assert len(out.outputs[0].token_ids) == MAX_TOKENS
        if not p.greedy:  # the sampled request: its own distribution, not its draws, is shared
            continue
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        ours, theirs = out.outputs[0].logprobs or [], ref.outputs[0].logprobs or []
        for lps, ref_lps in zip(ours, theirs, strict=True):
            assert lps.keys() == ref_lps.keys()
            for token_id, lp in lps.items():
                assert abs(lp.logprob - ref_lps[token_id].logprob) < 1e-4


@pytest.mark.parametrize(
    "engine",
    [
        dict(scheduler_config="sync"),
        # a pool of 12 blocks: preempted and swapped back; prefills in chunks of 16
        dict(
            scheduler_config="async",
            num_kv_blocks=12,
            max_prefill_tokens=16,
            swap_space_gb=0.01,
            preemption_mode="swap",
        ),
        dict(scheduler_config="async", num_kv_blocks=12, preemption_mode="recompute"),
        # drafts checked in one forward across the ranks, the rejected ones' KV overwritten
        dict(
            scheduler_config="async",
            speculative_config="ngram",
            ngram_min=1,
            speculation_cost_model=False,
        ),
    ],
    ids=["sync", "async-swap-chunked", "async-recompute", "async-speculation"],
)
def test_two_ranks_give_the_single_process_tokens(case, engine):
    model_dir, prompts, params, reference = case
    llm = LLM(model_from_path=str(model_dir), dtype="float32", tensor_parallel_size=2, **engine)
    try:
        first = llm.generate(prompts, params, use_tqdm=False)
        again = llm.generate(prompts[:2], params[:2], use_tqdm=False)  # from the prefix cache
        assert_same_outputs(first, reference, params)
        assert_same_outputs(again, reference[:2], params[:2])
        assert again[0].num_cached_tokens >= 32
        scheduler = llm.engine.scheduler
        if "num_kv_blocks" in engine:
            assert scheduler.num_preemptions > 0
        if "speculative_config" in engine:
            assert scheduler.speculator.stats.num_draft_tokens > 0
        assert scheduler.kv_cache.pool.num_free_blocks == scheduler.kv_cache.pool.num_blocks
        workers = llm.engine.workers.processes
        assert [p.is_alive() for p in workers] == [True]
    finally:
        llm.shutdown()
    assert [p.exitcode for p in workers] == [0]


def test_a_split_that_does_not_divide_is_refused_before_any_rank_starts(case):
    model_dir = case[0]
    with pytest.raises(ValueError, match="num_attention_heads=4 does not split"):
        LLM(model_from_path=str(model_dir), tensor_parallel_size=3)


def children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(c) for c in path.read_text().split()]


def test_a_dead_rank_turns_health_red_and_fails_requests(qwen3_dir, tmp_path):
    server = start_server(qwen3_dir, tmp_path / "server.log", "--tensor-parallel-size", "2")
    try:
        client = openai.OpenAI(base_url=server.api_url, api_key="x", max_retries=0)
        reply = client.chat.completions.create(
            model=MODEL_NAME, max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        )
        assert reply.choices[0].message.content is not None
        forward = httpx.get(server.base_url + "/forward").json()
        assert forward["tensor_parallel_size"] == 2 and forward["communication_backend"] == "gloo"
        assert forward["rank_devices"] == ["cpu", "cpu"]
        assert (forward["num_heads_per_rank"], forward["num_kv_heads_per_rank"]) == (2, 1)
        split = httpx.get(server.base_url + "/serve-config").json()["parallelism"]
        assert split["tensor_parallel_size"] == 2 and split["rank_devices"] == ["cpu", "cpu"]
        assert "tensor parallelism: world size 2, gloo, devices cpu, cpu" in server.log()
        engine = server.engine_pid()
        ranks = [
            pid
            for pid in children(engine)
            if b"resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_bytes()
        ]
        assert len(ranks) == 1, ranks
        kill_and_expect_a_red_health(server, ranks[0], "engine")
        assert "rank-1 exited" in server.log()
    finally:
        assert stop_server(server) == 0, server.log()


def test_the_tensor_parallel_bench_runs_each_size(tmp_path):
    """bench/tensor_parallel.py (the multi-GPU issue's measurement) on CI's CPU, at 1 and 2
    ranks of a tiny shape: every figure it reports is there and positive."""
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "tp.json"
    cmd = [sys.executable, str(root / "bench" / "tensor_parallel.py"), "--model", "tiny"]
    cmd += ["--device", "cpu", "--tp", "1,2", "--streams", "4", "--output-len", "8"]
    cmd += ["--batch1-tokens", "8", "--prompt-len", "16", "--hbm-gbps", "20", "--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300, cwd=root / "bench")
    doc = json.loads(out.read_text())
    assert [r["tensor_parallel_size"] for r in doc["results"]] == [1, 2]
    one, two = doc["results"]
    assert two["weight_gb_per_rank"] < 0.6 * one["weight_gb_per_rank"]  # each rank: its half
    for r in doc["results"]:
        assert r["batch1_tpot_ms"] > 0 and r["batched_output_tok_s"] > 0
        assert r["batch1_fraction_of_roofline"] > 0
