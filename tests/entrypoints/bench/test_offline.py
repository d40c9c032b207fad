"""`met bench offline` and `met bench latency` on the built-in model."""

import json

from metrale.entrypoints.cli import main


def test_offline_throughput_counts_the_forced_tokens(tmp_path, capsys):
    out = tmp_path / "o.json"
    assert (
        main(
            [
                "bench",
                "offline",
                "--num-prompts",
                "4",
                "--input-len",
                "16",
                "--output-len",
                "8",
                "--result-file",
                str(out),
            ]
        )
        == 0
    )
    doc = json.loads(out.read_text())
    assert doc["num_requests"] == 4 and doc["total_output_tokens"] == 32
    assert doc["total_num_tokens"] == 32 + 4 * 16  # token-exact prompts
    assert doc["output_tokens_per_second"] == doc["total_output_tokens"] / doc["elapsed_time"]
    assert doc["benchmark"] == "met bench offline" and doc["dataset"]["name"] == "random"
    assert "Throughput:" in capsys.readouterr().out


def test_latency_times_each_iteration(tmp_path):
    out = tmp_path / "l.json"
    assert (
        main(
            [
                "bench",
                "latency",
                "--batch-size",
                "2",
                "--input-len",
                "8",
                "--output-len",
                "4",
                "--num-iters",
                "3",
                "--num-iters-warmup",
                "1",
                "--result-file",
                str(out),
            ]
        )
        == 0
    )
    doc = json.loads(out.read_text())
    assert len(doc["latencies"]) == 3
    assert doc["percentiles"]["10"] <= doc["percentiles"]["50"] <= doc["percentiles"]["99"]
    assert min(doc["latencies"]) <= doc["avg_latency"] <= max(doc["latencies"])


def test_offline_samples_at_the_given_temperature(tmp_path, capsys):
    """Sampled requests (vLLM's benches sample at temperature 1) still run their forced length;
    the result says how they sampled. A temperature the engine refuses is an error, before any
    engine loads."""
    out = tmp_path / "t.json"
    args = ["bench", "offline", "--num-prompts", "3", "--input-len", "8", "--output-len", "6"]
    assert main([*args, "--temperature", "1.0", "--result-file", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["total_output_tokens"] == 18 and doc["temperature"] == 1.0
    capsys.readouterr()
    for command in ("offline", "latency"):
        assert main(["bench", command, "--temperature", "-1"]) == 2
        err = capsys.readouterr().err
        assert "temperature" in err and "engine ready" not in err
