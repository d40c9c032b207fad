"""The serving metrics' arithmetic on hand-made results: vLLM's definitions, exact values."""

import math

import pytest

from metrale.entrypoints.cli.bench.metrics import RequestResult, parse_goodput, summarize


def results() -> list[RequestResult]:
    return [
        # 5 tokens: TTFT 0.1 s, gaps 0.02, 0.02, 0.04, 0.02 -> E2EL 0.2, TPOT (0.2-0.1)/4
        RequestResult(10, True, 0.1, [0.02, 0.02, 0.04, 0.02], 0.2, output_tokens=5),
        # 3 tokens: TTFT 0.3, gaps 0.1, 0.1 -> E2EL 0.5, TPOT 0.1
        RequestResult(20, True, 0.3, [0.1, 0.1], 0.5, output_tokens=3),
        # 1 token: no TPOT (counted as 0 for goodput)
        RequestResult(30, True, 0.05, [], 0.05, output_tokens=1),
        RequestResult(40, False, error="HTTP 500: boom"),
    ]


def test_summary_follows_vllm_definitions():
    s = summarize(results(), 2.0, goodput={"ttft": 200, "tpot": 30})
    assert s["completed"] == 3 and s["failed"] == 1
    assert s["total_input_tokens"] == 60  # the failed request's prompt is not counted
    assert s["total_output_tokens"] == 9
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["output_throughput"] == pytest.approx(4.5)
    assert s["total_token_throughput"] == pytest.approx(34.5)
    assert s["mean_ttft_ms"] == pytest.approx(150.0)
    assert s["median_ttft_ms"] == pytest.approx(100.0)
    assert s["std_ttft_ms"] == pytest.approx(math.sqrt(((50**2) + (150**2) + (100**2)) / 3))
    # TPOT over the two requests of more than one token
    assert s["mean_tpot_ms"] == pytest.approx((25.0 + 100.0) / 2)
    # ITL over all six gaps; p90 by linear interpolation (numpy's default)
    gaps = sorted([20, 20, 40, 20, 100, 100])
    assert s["mean_itl_ms"] == pytest.approx(sum(gaps) / 6)
    assert s["p90_itl_ms"] == pytest.approx(gaps[4] + 0.5 * (gaps[5] - gaps[4]))
    # per token, as a server counts ITL: 0.1 s after request 1's first token over its 4 later
    # tokens and 0.2 s over request 2's 2
    assert s["mean_itl_per_token_ms"] == pytest.approx(1e3 * (0.1 + 0.2) / (4 + 2))
    assert s["p99_e2el_ms"] == pytest.approx(200 + 0.98 * (500 - 200))
    # good: request 1 (TTFT 100 <= 200, TPOT 25 <= 30) and request 3 (TTFT 50, TPOT 0)
    assert s["request_goodput"] == pytest.approx(1.0)


def test_output_tokens_fall_back_to_the_tokenizer_then_to_chunks():
    r = RequestResult(4, True, 0.1, [0.01, 0.01], 0.12, generated_text="a b c d")
    assert summarize([r], 1.0, count_tokens=lambda t: len(t.split()))["total_output_tokens"] == 4
    assert summarize([r], 1.0)["total_output_tokens"] == 3  # one per output chunk


def test_the_per_token_itl_spreads_a_chunk_of_several_tokens():
    """Six tokens in three chunks of two: two chunk gaps of 40 ms, five token gaps (0, 40, 0,
    40, 0 ms as a server observes them) averaging 16 ms."""
    r = RequestResult(4, True, 0.1, [0.04, 0.04], 0.18, output_tokens=6)
    s = summarize([r], 1.0)
    assert s["mean_itl_ms"] == pytest.approx(40.0)
    assert s["mean_itl_per_token_ms"] == pytest.approx(16.0)


def test_no_successful_request_gives_zeros_not_errors():
    s = summarize([RequestResult(5, False, error="x")], 1.0)
    assert s["completed"] == 0 and s["mean_ttft_ms"] == 0.0 and s["p99_itl_ms"] == 0.0


@pytest.mark.parametrize("bad", ["ttft", "speed:3", "ttft:fast", "tpot:-1", "e2el:inf"])
def test_bad_goodput_specs_are_refused(bad):
    with pytest.raises(ValueError, match="--goodput"):
        parse_goodput([bad])


def test_goodput_spec_parses():
    assert parse_goodput(["ttft:200", "e2el:1500.5"]) == {"ttft": 200.0, "e2el": 1500.5}
