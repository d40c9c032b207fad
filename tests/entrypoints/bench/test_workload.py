"""The datasets (seeded, token-exact) and the arrival schedule and concurrency cap."""

import asyncio
import json
import statistics

import pytest

from metrale import demo
from metrale.entrypoints.cli.bench.datasets import DatasetSpec, Sample, sample_requests
from metrale.entrypoints.cli.bench.load import LoadShape, run_load, send_delays
from metrale.entrypoints.cli.bench.metrics import RequestResult
from metrale.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_dir(demo.ensure_checkpoint())


def count(tokenizer, text):
    return len(tokenizer.encode(text, add_special_tokens=False))


def test_random_prompts_are_token_exact_ranged_and_seeded(tokenizer):
    spec = DatasetSpec("random", num_prompts=20, input_len=40, output_len=10, range_ratio=0.5)
    samples = sample_requests(spec, tokenizer)
    assert all(count(tokenizer, s.prompt) == s.prompt_len for s in samples)
    exact = [s for s in samples if 20 <= s.prompt_len <= 60]
    assert len(exact) == 20
    assert all(5 <= s.output_len <= 15 for s in samples)
    assert len({s.prompt_len for s in samples}) > 3
    assert sample_requests(spec, tokenizer) == samples  # the seed fixes them
    other = sample_requests(DatasetSpec("random", 20, seed=1, input_len=40), tokenizer)
    assert other != samples


def test_prefix_groups_share_their_prefix(tokenizer):
    spec = DatasetSpec("prefix", num_prompts=12, input_len=8, prefix_len=32, num_groups=3)
    samples = sample_requests(spec, tokenizer)
    heads = {s.prompt[:40] for s in samples}
    assert len(heads) == 3
    assert all(36 <= s.prompt_len <= 44 for s in samples)


def test_sharegpt_reads_a_local_file_and_filters_like_vllm(tokenizer, tmp_path):
    long = "word " * 1500
    convs = [
        {
            "conversations": [
                {"from": "human", "value": "Tell me a story about a cat please"},
                {"from": "gpt", "value": "Once upon a time a cat sat on a mat."},
            ]
        },
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "x"}]},
        {"conversations": [{"from": "human", "value": long}, {"from": "gpt", "value": long}]},
        {"conversations": [{"from": "human", "value": "only one turn"}]},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(convs))
    samples = sample_requests(DatasetSpec("sharegpt", num_prompts=10, path=path), tokenizer)
    assert [s.prompt for s in samples] == ["Tell me a story about a cat please"]
    assert samples[0].output_len == count(tokenizer, "Once upon a time a cat sat on a mat.")
    fixed = DatasetSpec("sharegpt", num_prompts=1, path=path, sharegpt_output_len=7)
    assert sample_requests(fixed, tokenizer)[0].output_len == 7
    with pytest.raises(ValueError, match="dataset-path"):
        sample_requests(DatasetSpec("sharegpt", path=tmp_path / "missing.json"), tokenizer)


def test_sonnet_prompts_share_the_fixed_lines_and_reach_the_length(tokenizer):
    spec = DatasetSpec("sonnet", num_prompts=5, input_len=300, prefix_len=60)
    samples = sample_requests(spec, tokenizer)
    assert all(s.prompt.startswith("Pick as many lines") for s in samples)
    assert len({s.prompt[:150] for s in samples}) == 1
    assert all(300 <= s.prompt_len < 400 for s in samples)


def test_poisson_gaps_average_one_over_the_rate_and_constant_ones_are_fixed():
    gaps = send_delays(4001, LoadShape(request_rate=50.0, seed=3))[1:]
    assert statistics.fmean(gaps) == pytest.approx(1 / 50, rel=0.05)
    assert statistics.stdev(gaps) == pytest.approx(1 / 50, rel=0.1)  # exponential: sd = mean
    bursty = send_delays(4001, LoadShape(request_rate=50.0, burstiness=0.25))[1:]
    assert statistics.stdev(bursty) > 1.5 * statistics.stdev(gaps)
    assert set(send_delays(5, LoadShape(request_rate=4, arrival="constant"))[1:]) == {0.25}
    assert send_delays(3, LoadShape()) == [0.0, 0.0, 0.0]


def test_the_concurrency_cap_holds():
    in_flight, peak = 0, 0

    async def send(sample):
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.01)
        in_flight -= 1
        return RequestResult(sample.prompt_len, True, 0.01, [], 0.01)

    samples = [Sample("p", 1, 1)] * 20
    results, _ = asyncio.run(run_load(samples, send, LoadShape(max_concurrency=3)))
    assert peak == 3 and all(r.success for r in results)


@pytest.mark.parametrize(
    "shape", [LoadShape(request_rate=0), LoadShape(max_concurrency=0), LoadShape(deadline_s=0)]
)
def test_bad_load_shapes_are_refused(shape):
    with pytest.raises(ValueError):
        shape.check()
