"""N-gram speculative decoding end to end: greedy outputs identical, token for token, to decoding
without it (itself transformers' greedy), under batching beside requests that sample or do not
speculate (logprobs),
chunked prefill, the prefix cache, preemption (recompute and swap) and async scheduling; every KV
block free at the end. Random weights reject most drafts; a scripted checkpoint that repeats
itself has most accepted."""

from __future__ import annotations

import pytest

from metrale import LLM, SamplingParams
from metrale.tokenizer import Tokenizer
from tests.conftest import build_checkpoint
from tests.entrypoints.test_llm_matches_transformers import prompts_of
from tests.scripted_checkpoint import build_scripted_checkpoint

MAX_NEW_TOKENS = 40
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
# Drafts after any repeated token: many drafts, mostly rejected on random weights.
ANY_REPEAT = '{"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3}'


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def case(request, tmp_path_factory):
    model_dir = build_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    source = prompts_of([24], seed=5)[0]
    # Texts that repeat: drafts from the prompt itself.
    prompts = [[*source, 7, 8, *source[:6]], *prompts_of([5, 33, 17], seed=6), source * 2]
    return model_dir, prompts


def generate(model_dir, prompts, params, **engine):
    if "speculative_config" in engine:  # every speculating request drafts, whatever it costs
        engine.setdefault("speculation_cost_model", False)
    llm = LLM(model_from_path=str(model_dir), dtype="float32", **engine)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], llm


@pytest.mark.parametrize("scheduling", ["sync", "async"])
def test_greedy_outputs_are_unchanged(case, scheduling):
    model_dir, prompts = case
    plain, _ = generate(model_dir, prompts, GREEDY, scheduler_config=scheduling)
    spec, llm = generate(
        model_dir,
        prompts,
        GREEDY,
        scheduler_config=scheduling,
        speculative_config=ANY_REPEAT,
        num_speculative_tokens=5,
    )
    assert spec == plain
    stats = llm.engine.scheduler.speculator.stats
    # Random weights rarely repeat themselves: most drafts are rejected (then drafting pauses).
    assert stats.num_draft_tokens >= 10
    assert sum(stats.accepted_per_position) == stats.num_accepted_tokens
    pool = llm.engine.scheduler.kv_cache.pool
    assert pool.num_free_blocks == pool.num_blocks


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_a_preemption_storm_with_chunked_prefill_changes_nothing(case, preemption_mode):
    model_dir, prompts = case
    params = [
        GREEDY,
        SamplingParams(temperature=0.8, seed=3, max_tokens=MAX_NEW_TOKENS, ignore_eos=True),
        GREEDY,
        SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True, logprobs=2),
        GREEDY,
    ]
    plain, _ = generate(model_dir, prompts, params, scheduler_config="async")
    spec, llm = generate(
        model_dir,
        prompts,
        params,
        scheduler_config="async",
        speculative_config=ANY_REPEAT,
        num_kv_blocks=10,
        max_prefill_tokens=16,
        swap_space_gb=0.01,
        preemption_mode=preemption_mode,
    )
    # The sampled request draws its randomness differently with drafts: its own test is the
    # sampler's (tests/runner/test_speculative_sampling.py).
    greedy_rows = [i for i, p in enumerate(params) if p.greedy]
    assert [spec[i] for i in greedy_rows] == [plain[i] for i in greedy_rows]
    assert len(spec[1]) == MAX_NEW_TOKENS
    scheduler = llm.engine.scheduler
    assert scheduler.num_preemptions > 0 and scheduler.speculator.stats.num_draft_tokens > 0
    assert scheduler.kv_cache.pool.num_free_blocks == scheduler.kv_cache.pool.num_blocks


def test_shared_prefixes_after_speculation_are_served_right(case):
    """Blocks filled while drafts were checked enter the prefix cache only with the tokens the
    request kept: a later request sharing that text reads the right KV."""
    model_dir, prompts = case
    spec, llm = generate(model_dir, prompts[:1], GREEDY, speculative_config=ANY_REPEAT)
    assert llm.engine.scheduler.speculator.stats.num_draft_tokens > 0
    # The first request's prompt and output, as the next prompt: most of it from the cache.
    again = llm.generate([prompts[0] + spec[0]], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens >= 48
    fresh, _ = generate(model_dir, [prompts[0] + spec[0]], GREEDY)
    assert again.outputs[0].token_ids == fresh[0]


THINK, END_THINK = 3, 4  # the demo tokenizer's <think> and </think>


def host_decided_params() -> list[SamplingParams]:
    """Greedy requests whose steps the host shapes: grammars (their text repeats: drafts the
    grammar keeps; drafts from the prompt it rejects), a thinking budget the model would overrun
    (its forced close within the drafts' reach), and one followed by a grammar."""
    import json

    from metrale.sampling_params import StructuredOutput, ThinkingBudget

    schema = {
        "type": "object",
        "properties": {"n": {"type": "array", "items": {"type": "integer"}}},
    }
    greedy = dict(temperature=0.0, max_tokens=MAX_NEW_TOKENS)
    overrun = dict(logit_bias={END_THINK: -100.0}, **greedy)  # the model would never close it
    return [
        SamplingParams(structured=StructuredOutput("regex", "(the cat ){10}"), **greedy),
        SamplingParams(structured=StructuredOutput("json", json.dumps(schema)), **greedy),
        SamplingParams(
            ignore_eos=True,
            thinking=ThinkingBudget(13, THINK, END_THINK, starts_inside=True),
            **overrun,
        ),
        SamplingParams(
            thinking=ThinkingBudget(9, THINK, END_THINK, starts_inside=True),
            structured=StructuredOutput("regex", "(x|y){20}"),
            **overrun,
        ),
    ]


@pytest.mark.parametrize("scheduling", ["sync", "async"])
def test_grammar_and_thinking_budget_requests_speculate_unchanged(case, scheduling):
    model_dir, prompts = case
    params = host_decided_params()
    prompts = [prompts[0], prompts[4], prompts[0], prompts[4]]
    plain, _ = generate(model_dir, prompts, params, scheduler_config=scheduling)
    spec, llm = generate(
        model_dir,
        prompts,
        params,
        scheduler_config=scheduling,
        speculative_config=ANY_REPEAT,
        num_speculative_tokens=6,
    )
    assert spec == plain
    assert plain[2][13] == END_THINK and END_THINK not in plain[2][:13]  # forced, on time
    assert plain[3].index(END_THINK) == 9 and len(plain[3]) == 9 + 1 + 20 + 1  # then a stop
    stats = llm.engine.scheduler.speculator.stats
    assert stats.num_draft_tokens >= 10 and stats.num_accepted_tokens > 0
    pool = llm.engine.scheduler.kv_cache.pool
    assert pool.num_free_blocks == pool.num_blocks


KEYWORD = " harmonic"
# A reply that repeats itself, then departs: drafts from the first copy are accepted in the
# later ones until each departure, which rejects the rest of the draft.
REPLY = "Check the cache, then the disk, then the network. " * 3 + "Check the logs instead."


def repeating_model(tmp_path) -> tuple[str, list[int], list[int]]:
    """A scripted checkpoint that says REPLY (which repeats itself) when asked: its path, the
    chat prompt that asks, and the reply's tokens with the end of turn."""
    scripted = build_scripted_checkpoint(tmp_path, {KEYWORD: REPLY})
    tokenizer = Tokenizer.from_dir(scripted.path)
    text = tokenizer.apply_chat_template([{"role": "user", "content": f"Say it{KEYWORD}."}])
    prompt = tokenizer.encode(text, add_special_tokens=False)
    reply = [*scripted.replies[KEYWORD].token_ids, tokenizer.token_to_id("<|im_end|>")]
    return str(scripted.path), prompt, reply


@pytest.mark.parametrize("scheduling", ["sync", "async"])
def test_a_model_that_repeats_itself_takes_several_tokens_a_step(tmp_path, scheduling):
    scripted = build_scripted_checkpoint(tmp_path, {KEYWORD: REPLY})
    tokenizer = Tokenizer.from_dir(scripted.path)
    text = tokenizer.apply_chat_template([{"role": "user", "content": f"Say it{KEYWORD}."}])
    prompt = tokenizer.encode(text, add_special_tokens=False)
    reply = list(scripted.replies[KEYWORD].token_ids)
    params = SamplingParams(temperature=0.0, max_tokens=len(reply) + 4, logprobs=3)
    plain, plain_llm = generate(scripted.path, [prompt], params, scheduler_config=scheduling)
    spec, llm = generate(
        scripted.path,
        [prompt],
        params,
        scheduler_config=scheduling,
        speculative_config="ngram",
        num_speculative_tokens=8,
    )
    assert plain[0] == spec[0] == [*reply, tokenizer.token_to_id("<|im_end|>")]
    stats = llm.engine.scheduler.speculator.stats
    # Most of the second and third copies came as accepted drafts; departures rejected some.
    # (Under async scheduling the first copy's fruitless lookups pause drafting a while.)
    assert stats.num_accepted_tokens >= len(reply) // (2 if scheduling == "sync" else 3)
    assert stats.num_draft_tokens > stats.num_accepted_tokens
    steps = [s for s in llm.engine.step_stats if s.num_requests]
    # a step per token the drafts did not bring (async computes one more past the end)
    assert len(steps) <= len(reply) + 2 - stats.num_accepted_tokens
    # Logprobs for every token, accepted drafts too, as decoding one at a time gives them.
    with_logprobs = [
        x.generate([prompt], params, use_tqdm=False)[0].outputs[0].logprobs
        for x in (plain_llm, llm)
    ]
    assert len(with_logprobs[0]) == len(with_logprobs[1]) == len(plain[0])
    for ours, theirs in zip(*with_logprobs, strict=True):
        assert ours.keys() == theirs.keys()
        for token, lp in ours.items():
            assert abs(lp.logprob - theirs[token].logprob) < 1e-4 and lp.rank == theirs[token].rank


def test_the_engine_measures_where_drafts_pay_and_outputs_stay_the_same(case):
    model_dir, prompts = case
    plain, _ = generate(model_dir, prompts, GREEDY)
    spec, llm = generate(
        model_dir, prompts, GREEDY, speculative_config=ANY_REPEAT, speculation_cost_model=True
    )
    assert spec == plain
    costs = llm.engine.scheduler.speculator.costs
    assert costs.batch_sizes[0] == 1 and costs.num_drafts == 4
    assert all(t > 0 for t in (*costs.plain_s, *costs.verify_s))
    assert all(costs.min_acceptance(b) >= 0 for b in costs.batch_sizes)


@pytest.mark.parametrize("scheduling", ["sync", "async"])
def test_stop_strings_cut_where_they_cut_without_drafts(tmp_path, scheduling):
    """Accepted drafts bring several tokens a step; a stop string inside them ends the text
    exactly where it ends one token at a time (the stop not included), and so does a stop
    token id among them. The prompt holds the reply, so drafts come from it from the start."""
    scripted = build_scripted_checkpoint(tmp_path, {KEYWORD: REPLY})
    tokenizer = Tokenizer.from_dir(scripted.path)
    message = {"role": "user", "content": f"Say it{KEYWORD}: {REPLY}"}
    prompt = tokenizer.encode(tokenizer.apply_chat_template([message]), add_special_tokens=False)
    reply = list(scripted.replies[KEYWORD].token_ids)
    # a token first seen well into the reply: a stop id the drafts bring
    stop_id = next(t for i, t in enumerate(reply) if i >= 6 and t not in reply[:i])
    by_string = SamplingParams(temperature=0.0, max_tokens=len(reply), stop=["then the disk"])
    by_token = SamplingParams(temperature=0.0, max_tokens=len(reply), stop_token_ids=[stop_id])
    outs = []
    for spec in (None, "ngram"):
        engine = {} if spec is None else {"speculative_config": spec}
        llm = LLM(
            model_from_path=str(scripted.path),
            dtype="float32",
            scheduler_config=scheduling,
            **engine,
            **({"speculation_cost_model": False} if spec else {}),
        )
        outs.append([o.outputs[0] for o in llm.generate([prompt, prompt], [by_string, by_token])])
        if spec:
            assert llm.engine.scheduler.speculator.stats.num_accepted_tokens >= 6
    (plain_string, plain_token), (spec_string, spec_token) = outs
    assert spec_string.text == plain_string.text == "Check the cache, "
    assert spec_string.finish_reason == plain_string.finish_reason == "stop"
    assert spec_token.token_ids == plain_token.token_ids and spec_token.token_ids[-1] == stop_id
    assert spec_token.finish_reason == "stop"


def test_bad_speculative_settings_are_refused(case):
    model_dir, _ = case
    with pytest.raises(ValueError, match="ngram_min"):
        LLM(model_from_path=str(model_dir), speculative_config="ngram", ngram_min=4, ngram_max=2)
    with pytest.raises(ValueError, match="not known"):
        LLM(model_from_path=str(model_dir), speculative_config="eagle")
    with pytest.raises(ValueError, match="need --speculative-config"):
        LLM(model_from_path=str(model_dir), num_speculative_tokens=3)
