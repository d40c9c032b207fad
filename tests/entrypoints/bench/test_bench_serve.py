"""`met bench serve` end to end against a scripted server with known delays (scripted_server.py)
for each of the three endpoints."""

import json
import time

import pytest

from metrale import demo
from metrale.entrypoints.cli import main
from tests.entrypoints.bench.scripted_server import GAP_S, OUTPUT_LEN, TTFT_S, scripted_app


def bench(url: str, tmp_path, *extra: str) -> dict:
    out = tmp_path / "r.json"
    code = main(
        [
            "bench",
            "serve",
            "--base-url",
            url,
            "--tokenizer",
            str(demo.ensure_checkpoint()),
            "--input-len",
            "16",
            "--output-len",
            str(OUTPUT_LEN),
            "--num-prompts",
            "6",
            "--disable-progress",
            "--result-file",
            str(out),
            *extra,
        ]
    )
    doc = json.loads(out.read_text())
    doc["exit_code"] = code
    return doc


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions", "/v1/messages"])
def test_metrics_match_the_scripted_delays(serve_app, tmp_path, endpoint):
    url = serve_app(scripted_app(fail_request=3))
    doc = bench(
        url,
        tmp_path,
        "--endpoint",
        endpoint,
        "--max-concurrency",
        "2",
        "--no-warmup",
        "--goodput",
        "ttft:1000",
        "tpot:1000",
    )
    (target,) = doc["targets"]
    assert target["model"] == "scripted"  # read off /v1/models
    (run,) = target["runs"]
    assert run["completed"] == 5 and run["failed"] == 1
    assert run["errors"] == {"HTTP 500": 1}
    assert run["total_output_tokens"] == 5 * OUTPUT_LEN  # the usage's count
    assert run["total_input_tokens"] == 5 * 16  # token-exact random prompts
    assert TTFT_S * 1e3 <= run["mean_ttft_ms"] < TTFT_S * 1e3 + 60
    assert GAP_S * 1e3 <= run["median_itl_ms"] < GAP_S * 1e3 + 15
    expected_e2el = 1e3 * (TTFT_S + (OUTPUT_LEN - 1) * GAP_S)
    assert expected_e2el <= run["mean_e2el_ms"] < expected_e2el + 80
    assert run["mean_tpot_ms"] == pytest.approx(
        (run["mean_e2el_ms"] - run["mean_ttft_ms"]) / (OUTPUT_LEN - 1), rel=1e-6
    )  # every request has the same token count, so the means commute
    assert run["request_goodput"] == pytest.approx(run["request_throughput"])
    assert doc["exit_code"] == 0


def test_the_deadline_bounds_a_run_of_hung_requests(serve_app, tmp_path):
    url = serve_app(scripted_app(hang=True))
    start = time.perf_counter()
    doc = bench(url, tmp_path, "--deadline", "1", "--no-warmup")
    assert time.perf_counter() - start < 10
    (run,) = doc["targets"][0]["runs"]
    assert run["completed"] == 0 and run["failed"] == 6
    assert 1.0 <= run["duration"] < 3
    assert doc["exit_code"] == 1  # a run with nothing completed fails the command


def test_a_sweep_and_two_targets_then_plots_and_compare(serve_app, tmp_path, capsys):
    a, b = serve_app(scripted_app()), serve_app(scripted_app())
    doc = bench(
        f"a={a}",
        tmp_path,
        "--base-url",
        f"b={b}",
        "--max-concurrency",
        "1,3",
        "--request-rate",
        "inf",
        "--plot",
        str(tmp_path / "plots"),
    )
    assert [t["name"] for t in doc["targets"]] == ["a", "b"]
    assert [r["max_concurrency"] for r in doc["targets"][0]["runs"]] == [1, 3]
    # three at once overlap: the run takes about a third of the one-at-a-time run
    one, three = doc["targets"][0]["runs"]
    assert three["duration"] < 0.7 * one["duration"]
    for name in ("latency_vs_request_rate", "throughput_vs_concurrency", "ttft_cdf"):
        assert (tmp_path / "plots" / f"{name}.png").stat().st_size > 1000
    assert doc["git_sha"] is None or len(doc["git_sha"]) == 40
    capsys.readouterr()
    assert main(["bench", "serve", "--compare", str(tmp_path / "r.json")]) == 0
    table = capsys.readouterr().out
    assert table.count("\na ") == 2 and table.count("\nb ") == 2


@pytest.mark.parametrize("distinct", [False, True])
def test_distinct_prompts_give_each_run_of_a_sweep_its_own(serve_app, tmp_path, distinct):
    bodies: list[dict] = []
    url = serve_app(scripted_app(bodies=bodies))
    extra = ["--max-concurrency", "1,2", "--no-warmup"] + ["--distinct-prompts"] * distinct
    doc = bench(url, tmp_path, *extra)
    assert doc["exit_code"] == 0
    first, second = ({b["prompt"] for b in bodies[i * 6 : (i + 1) * 6]} for i in range(2))
    assert len(first) == len(second) == 6
    assert (first & second == set()) if distinct else (first == second)


def test_a_dead_server_is_a_clear_error(tmp_path, capsys):
    code = main(
        [
            "bench",
            "serve",
            "--base-url",
            "http://127.0.0.1:9",
            "--tokenizer",
            str(demo.ensure_checkpoint()),
            "--num-prompts",
            "1",
        ]
    )
    assert code == 2
    assert "is the server up" in capsys.readouterr().err
