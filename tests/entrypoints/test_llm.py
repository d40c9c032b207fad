"""The offline `LLM` API: inputs, outputs, sampling knobs and errors."""

from __future__ import annotations

import dataclasses
import gc
import weakref

import pytest

from metrale import LLM, SamplingParams
from metrale.engine.heap import YOUNG_THRESHOLD


@pytest.fixture(scope="module", params=["sync", "async"])
def llm(qwen3_dir, request):
    """Every knob under both schedulings: async feeds decodes tokens the host has not seen."""
    return LLM(model_from_path=str(qwen3_dir), max_seq_len=128, scheduler_config=request.param)


def test_text_prompt_is_tokenized_and_output_detokenized(llm):
    (out,) = llm.generate(
        "Hello, wörld! 你好",
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        use_tqdm=False,
    )
    tokenizer = llm.get_tokenizer()
    assert out.prompt == "Hello, wörld! 你好"
    assert out.prompt_token_ids == tokenizer.encode("Hello, wörld! 你好")
    completion = out.outputs[0]
    assert len(completion.token_ids) == 12 and completion.finish_reason == "length"
    assert completion.text == tokenizer.decode(completion.token_ids)


def test_outputs_keep_prompt_order_and_token_prompts(llm):
    prompts = [[5, 6, 7], "abc", [9] * 40, "x"]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 9, 1, 5)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [3, 9, 1, 5]
    assert outputs[0].prompt_token_ids == [5, 6, 7] and outputs[0].prompt is None
    # Batched or alone, greedy gives the same tokens.
    alone = llm.generate(prompts[1], params[1], use_tqdm=False)[0]
    assert alone.outputs[0].token_ids == outputs[1].outputs[0].token_ids


def test_seeded_sampling_is_reproducible_and_n_fans_out(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, seed=123, ignore_eos=True)
    a = llm.generate("story", params, use_tqdm=False)[0].outputs[0].token_ids
    b = llm.generate(["other", "story"], params, use_tqdm=False)[1].outputs[0].token_ids
    assert a == b, "a seeded request does not depend on what shares its batch"
    other_seed = SamplingParams(temperature=1.0, max_tokens=10, seed=124, ignore_eos=True)
    assert llm.generate("story", other_seed, use_tqdm=False)[0].outputs[0].token_ids != a

    out = llm.generate(
        "story", SamplingParams(n=3, temperature=1.0, max_tokens=6, seed=1), use_tqdm=False
    )[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert (
        out.outputs[0].token_ids
        == llm.generate(
            "story", SamplingParams(temperature=1.0, max_tokens=6, seed=1), use_tqdm=False
        )[0]
        .outputs[0]
        .token_ids
    )
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_stop_token_ids_min_tokens_and_logprobs(llm):
    greedy = (
        llm.generate(
            [3, 4, 5], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False
        )[0]
        .outputs[0]
        .token_ids
    )
    stop = greedy[3]
    first = greedy.index(stop)
    out = llm.generate(
        [3, 4, 5],
        SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop], logprobs=3),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.token_ids == greedy[: first + 1] and out.finish_reason == "stop"
    assert len(out.logprobs) == len(out.token_ids)
    for token, position in zip(out.token_ids, out.logprobs, strict=True):
        assert position[token].rank == 1  # greedy picks the most likely token
        assert sorted(lp.rank for lp in position.values()) == [1, 2, 3]
    banned = llm.generate(
        [3, 4, 5],
        SamplingParams(temperature=0, max_tokens=8, min_tokens=8, stop_token_ids=[stop]),
        use_tqdm=False,
    )[0].outputs[0]
    assert stop not in banned.token_ids and len(banned.token_ids) == 8


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"logprobs": 1000}, "logprobs"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"n": 0}, "n"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}=.*out of range"):
        SamplingParams(**kwargs)


def test_bad_requests_are_refused_and_the_engine_keeps_serving(llm):
    ok = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with pytest.raises(ValueError, match=r"prompt has 200 tokens; max_seq_len is 128"):
        llm.generate([[7] * 10, [7] * 200], ok, use_tqdm=False)
    with pytest.raises(ValueError, match=r"token id 999999 is out of range"):
        llm.generate([[1, 999999]], ok, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate([[]], ok, use_tqdm=False)
    with pytest.raises(ValueError, match="2 sampling_params for 1 prompts"):
        llm.generate(["a"], [ok, ok], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests(), "nothing of a refused batch was queued"
    (out,) = llm.generate([[7] * 10], ok, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4


def test_unknown_architecture_is_a_clear_error(tmp_path, qwen3_dir):
    import json
    import shutil

    shutil.copytree(qwen3_dir, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["architectures"] = ["FancyNewForCausalLM"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"FancyNewForCausalLM.*not supported.*LlamaForCausalLM"):
        LLM(model_from_path=str(tmp_path / "m"))


def test_demo_model_runs_offline_and_says_its_weights_are_random(caplog, monkeypatch):
    monkeypatch.setenv("METRALE_DEMO", "random")  # the random one even with SmolLM2 installed
    with caplog.at_level("WARNING"):
        llm = LLM()
    assert "weights are random" in caplog.text
    assert llm.config.is_demo and llm.config.model.architecture == "Qwen3ForCausalLM"
    num_params = sum(p.numel() for p in llm.engine.runner.model.parameters())
    assert 1_000_000 < num_params < 10_000_000
    prompt = llm.get_tokenizer().apply_chat_template([{"role": "user", "content": "hi"}])
    (out,) = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    assert 1 <= len(out.outputs[0].token_ids) <= 5
    # Deterministic: a second engine on the same generated checkpoint says the same.
    again = LLM().generate(prompt, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    assert again[0].outputs[0].token_ids == out.outputs[0].token_ids


def test_logit_bias_forces_a_token_every_greedy_step_and_spares_its_batch(llm):
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    biased = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logit_bias={42: 100.0})
    alone = llm.generate("story", plain, use_tqdm=False)[0].outputs[0].token_ids
    outputs = llm.generate(["story", "story"], [biased, plain], use_tqdm=False)
    assert outputs[0].outputs[0].token_ids == [42] * 8
    assert outputs[1].outputs[0].token_ids == alone


def test_frequency_penalty_breaks_greedy_repetition(llm):
    def most_repeated(frequency_penalty: float) -> int:
        params = SamplingParams(
            temperature=0, max_tokens=32, ignore_eos=True, frequency_penalty=frequency_penalty
        )
        token_ids = llm.generate([[9] * 40], params, use_tqdm=False)[0].outputs[0].token_ids
        return max(token_ids.count(t) for t in token_ids)

    assert most_repeated(0.0) >= 6, "the unpenalised run loops on a few tokens"
    assert most_repeated(2.0) <= 2


def test_truncation_samplers_shape_what_is_sampled_in_the_engine(llm):
    """A tiny top-nσ leaves only the top logit: hot sampling gives the greedy tokens; XTC that
    always fires with a low threshold never gives the greedy token where two pass it."""
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = llm.generate("story", greedy, use_tqdm=False)[0].outputs[0].token_ids
    hot = SamplingParams(temperature=1.5, max_tokens=12, ignore_eos=True, top_n_sigma=1e-4)
    for seed in (1, 2):
        params = dataclasses.replace(hot, seed=seed)
        assert llm.generate("story", params, use_tqdm=False)[0].outputs[0].token_ids == expected
    xtc = SamplingParams(
        temperature=1.0, max_tokens=1, seed=3, xtc_threshold=1e-6, xtc_probability=1.0
    )
    first = llm.generate("story", xtc, use_tqdm=False)[0].outputs[0].token_ids
    assert first != expected[:1]  # every token passes the threshold: the top ones are cut


def test_thinking_budget_forces_the_block_closed(llm):
    from metrale.sampling_params import ThinkingBudget

    think, end_think = 3, 4  # the demo tokenizer's <think> and </think>
    budget = ThinkingBudget(
        max_tokens=5, start_token_id=think, end_token_id=end_think, starts_inside=True
    )
    params = SamplingParams(
        temperature=0,
        max_tokens=12,
        ignore_eos=True,
        thinking=budget,
        logit_bias={end_think: -100.0},
    )  # the model would never close it
    out = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids
    assert out[5] == end_think and end_think not in out[:5]
    # A block the model opens itself is counted from its opener; a reopened one closes at once.
    opener = SamplingParams(
        temperature=0,
        max_tokens=12,
        ignore_eos=True,
        thinking=ThinkingBudget(2, think, end_think),
        logit_bias={think: 100.0, end_think: -100.0},
    )
    out = llm.generate([[5, 6, 7]], opener, use_tqdm=False)[0].outputs[0].token_ids
    assert out[:1] == [think] and end_think in out
    first_close = out.index(end_think)
    assert first_close <= 1 + 2 + 1, out  # <think>, at most 2 thinking tokens, then </think>


SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}


def test_structured_output_follows_the_grammar(llm):
    import json

    from metrale.sampling_params import StructuredOutput

    schema = StructuredOutput("json", json.dumps(SCHEMA))
    plain = SamplingParams(temperature=1.0, seed=0, max_tokens=40)
    constrained = [
        SamplingParams(temperature=1.0, seed=seed, max_tokens=40, structured=schema)
        for seed in range(4)
    ]
    outputs = llm.generate(["a", "b", "c", "d", "e"], [plain, *constrained], use_tqdm=False)
    for out in outputs[1:]:
        completion = out.outputs[0]
        value = json.loads(completion.text)
        assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool)
        assert 0 <= value["n"] <= 9
        assert completion.finish_reason == "stop", "the grammar ends in a stop token"
    regex = StructuredOutput("regex", "[0-9]{3}-[a-c]{2}")
    (out,) = llm.generate(
        ["x"],
        SamplingParams(temperature=1.0, seed=1, max_tokens=20, structured=regex),
        use_tqdm=False,
    )
    import re

    assert re.fullmatch("[0-9]{3}-[a-c]{2}", out.outputs[0].text)
    with pytest.raises(ValueError, match="cannot compile"):
        llm.generate(
            ["x"], SamplingParams(structured=StructuredOutput("regex", "([")), use_tqdm=False
        )


def test_priority_orders_offline_requests_and_needs_the_priority_policy(qwen3_dir, llm):
    llm_p = LLM(model_from_path=str(qwen3_dir), scheduler="priority", max_num_seqs=1)
    admitted: list[str] = []
    schedule = llm_p.engine.scheduler.schedule

    def spy():  # records the order requests first reach a step
        out = schedule()
        admitted.extend(c.request_id for c in out.chunks if c.request_id not in admitted)
        return out

    llm_p.engine.scheduler.schedule = spy
    params = SamplingParams(temperature=0, max_tokens=3)
    outputs = llm_p.generate([[5, 6], [7, 8], [9, 10]], params, use_tqdm=False, priority=[2, 0, 1])
    assert [len(o.outputs[0].token_ids) for o in outputs] == [3, 3, 3]
    ids = [o.request_id for o in outputs]
    assert admitted == [ids[1], ids[2], ids[0]]
    with pytest.raises(ValueError, match="priority policy"):
        llm.generate([[5, 6]], params, use_tqdm=False, priority=[1])
    with pytest.raises(ValueError, match="2 priorities for 1 prompts"):
        llm_p.generate([[5, 6]], params, use_tqdm=False, priority=[1, 2])


def test_an_llm_keeps_its_startup_heap_out_of_the_collector_and_leaves_nothing_behind(
    qwen3_dir, monkeypatch
):
    """Frozen while it runs (a full collection would walk the model and the pool), its young
    objects collected less often; once it is gone the collector is as it was, and the model,
    which the compiled CPU decode holds in reference cycles, is collected like any garbage."""
    monkeypatch.setenv("METRALE_COMPILE_CPU_DECODE", "1")  # as `met serve` runs on a CPU
    monkeypatch.setenv("METRALE_FREEZE_HEAP", "1")  # as outside the test suite
    thresholds = gc.get_threshold()
    llm = LLM(model_from_path=str(qwen3_dir), max_seq_len=128)
    assert llm.engine.runner.compiled is not None
    assert gc.get_freeze_count() > 0
    assert gc.get_threshold() == (YOUNG_THRESHOLD, *thresholds[1:])
    model = weakref.ref(llm.engine.runner.model)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
    del llm
    assert gc.get_threshold() == thresholds and gc.get_freeze_count() == 0
    gc.collect()
    assert model() is None
