"""`met bench certify`: the shipped suite and its box classes, the verdict against thresholds on a
scripted server whose delays are known, calibration round trips, and the whole command starting
a real `met serve` (the random demo model) whose prefix cache must serve the shared prefixes."""

import json
import tomllib
from pathlib import Path

import pytest

from metrale import demo
from metrale.entrypoints.cli import main
from metrale.entrypoints.cli.bench.certify_suite import (
    Box,
    Suite,
    calibrated_box,
    judge,
    measure,
)
from tests.entrypoints.bench.scripted_server import TTFT_S, scripted_app

GIB = 2**30


def cpu_box(cores: int) -> dict:
    return {"cpu": {"cores": cores, "model": "test"}, "gpus": []}


def gpu_box(name: str, memory_gib: float, cores: int = 16) -> dict:
    gpu = {"name": name, "memory_total_bytes": int(memory_gib * GIB)}
    return {"cpu": {"cores": cores, "model": "test"}, "gpus": [gpu]}


def test_the_shipped_suite_has_the_four_checks_and_thresholds_for_this_box_and_the_h200():
    suite = Suite.load()
    assert [c.name for c in suite.checks] == ["decode_b1", "ladder", "prefix_cache", "long_context"]
    cpu = suite.box_for(cpu_box(2))
    assert cpu is not None and cpu.thresholds and cpu.model == "metrale-demo"
    h200 = suite.box_for(gpu_box("NVIDIA H200", 139.8))
    assert h200 is not None and h200 is not cpu and h200.thresholds
    assert suite.box_for(gpu_box("NVIDIA H200", 139.8, cores=2)) is h200  # GPUs decide first
    assert suite.box_for(gpu_box("NVIDIA L4", 22)) is None
    assert suite.box_for(cpu_box(64)) is None  # a class with no runs behind it has no numbers
    for box in suite.boxes:  # every box raises the ladder by its own flags, parsed by bench
        ladder = next(c for c in suite.checks if c.name == "ladder")
        assert box.check_args(ladder)[: len(ladder.args)] == list(ladder.args)


CHECK = "[[check]]\nname = 'c'\nargs = ['--num-prompts', '2']\nmeasure = ['median_ttft_ms']\n"


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        (CHECK + "[[box]]\nname='b'\nmatch={cores=2}\n", "unknown match keys ['cores']"),
        (CHECK + "[[box]]\nname='b'\n[box.thresholds]\nno={min_x=1}\n", "thresholds for no check"),
        (CHECK + "[[box]]\nname='b'\n[box.thresholds]\nc={x=1}\n", "c.x: use min_ or max_"),
        (CHECK + "[[box]]\nname='b'\n[box.args]\nno=['--seed', '1']\n", "args for no check"),
        ("", "no [[check]]"),
        ("[[check]]\nname = 'c'\n", "'args'"),
        ("[[check]\n", "not a certify suite"),
    ],
)
def test_a_broken_suite_is_a_clear_error(tmp_path, text, problem):
    path = tmp_path / "suite.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match="not a certify suite") as e:
        Suite.load(path)
    assert problem in str(e.value)


def run_row(throughput: float, ttft_ms: float, failed: int = 0, **extra) -> dict:
    return {
        "output_throughput": throughput,
        "median_ttft_ms": ttft_ms,
        "failed": failed,
        **extra,
    }


def test_measure_derives_scaling_speedup_and_hit_rate_and_counts_failures():
    suite = Suite.parse(
        {
            "check": [
                {"name": "l", "args": [], "measure": ["output_throughput", "scaling"]},
                {
                    "name": "p",
                    "args": [],
                    "baseline": [],
                    "measure": ["ttft_speedup", "prefix_cache_hit_rate"],
                },
            ]
        },
        "test",
    )
    ladder, prefix = suite.checks
    runs = [run_row(10, 100), run_row(25, 300, failed=1), run_row(60, 900)]
    assert measure(ladder, runs, []) == {"output_throughput": 60, "scaling": 6.0, "failed": 1}
    base = [run_row(1, 800, failed=2)]
    warm = [run_row(1, 100, server_prefix_cache_hit_rate=0.7)]
    assert measure(prefix, warm, base) == {
        "ttft_speedup": 8.0,
        "prefix_cache_hit_rate": 0.7,
        "failed": 2,
    }
    # a server without /metrics has no hit rate: the value is missing, and a bound on it fails
    assert measure(prefix, [run_row(1, 100)], base)["prefix_cache_hit_rate"] is None
    box = Box("b", "", {}, thresholds={"p": {"min_prefix_cache_hit_rate": 0.5}})
    (failed, hit_rate) = judge(prefix, measure(prefix, [run_row(1, 100)], base), box)
    assert not failed.passed and not hit_rate.passed


def test_bounds_are_inclusive_and_failures_always_judged():
    (check,) = Suite.parse({"check": [{"name": "c", "args": []}]}, "t").checks
    box = Box("b", "", {}, thresholds={"c": {"min_output_throughput": 10, "max_median_ttft_ms": 5}})
    values = {"output_throughput": 10.0, "median_ttft_ms": 5.0, "failed": 0}
    assert [v.passed for v in judge(check, values, box)] == [True, True, True]
    values = {"output_throughput": 9.99, "median_ttft_ms": 5.01, "failed": 1}
    assert [v.passed for v in judge(check, values, box)] == [False, False, False]
    assert [v.metric for v in judge(check, values, None)] == ["failed"]


@pytest.mark.parametrize("hardware", [cpu_box(2), gpu_box("NVIDIA H200", 139.8)])
def test_a_calibrated_box_parses_matches_its_machine_and_passes_its_own_run(hardware):
    values = {
        "c": {"output_throughput": 100.0, "median_ttft_ms": 50.0, "scaling": 4.0, "failed": 0},
    }
    text = calibrated_box("mine", hardware, "m", ["--max-seq-len", "4096"], values, "a run")
    suite = Suite.parse(tomllib.loads(CHECK + text), "calibrated")
    (box,) = suite.boxes
    assert suite.box_for(hardware) is box
    assert box.serve_args == ("--max-seq-len", "4096") and box.model == "m"
    assert box.thresholds["c"] == {
        "min_output_throughput": 75.0,
        "max_median_ttft_ms": 66.7,
        "min_scaling": 3.0,
    }
    assert all(v.passed for v in judge(suite.checks[0], values["c"], box))
    slower = values["c"] | {"output_throughput": 70.0}
    assert not all(v.passed for v in judge(suite.checks[0], slower, box))


def scripted_suite(tmp_path, ttft_bound_ms: float) -> str:
    path = tmp_path / f"suite-{ttft_bound_ms}.toml"
    path.write_text(
        "[[check]]\nname = 'decode'\ntitle = 'two at once'\n"
        "args = ['--input-len', '16', '--output-len', '4', '--num-prompts', '4', "
        "'--max-concurrency', '1,2']\n"
        "measure = ['median_ttft_ms', 'scaling']\n"
        "[[box]]\nname = 'here'\nmatch = { min_cores = 1 }\nmodel = 'scripted'\n"
        "[box.thresholds]\n"
        f"decode = {{ max_median_ttft_ms = {ttft_bound_ms}, min_scaling = 1.5 }}\n"
    )
    return str(path)


@pytest.mark.parametrize(("ttft_bound_ms", "code"), [(1000.0, 0), (TTFT_S * 1e3 / 2, 1)])
def test_the_verdict_on_a_server_with_known_delays(serve_app, tmp_path, ttft_bound_ms, code):
    """TTFT is TTFT_S by construction: a bound above it passes, one below fails; two requests
    at once finish about twice as fast (scaling), and the report says which held."""
    url = serve_app(scripted_app())
    report = tmp_path / "report"
    argv = ["bench", "certify", "--base-url", url, "--report", str(report)]
    argv += ["--suite", scripted_suite(tmp_path, ttft_bound_ms)]
    argv += ["--tokenizer", str(demo.ensure_checkpoint())]
    assert main(argv) == code
    doc = json.loads((report / "certify.json").read_text())
    assert doc["box"] == "here" and doc["thresholds_apply"]
    verdicts = {v["metric"]: v for v in doc["verdicts"]}
    assert verdicts["median_ttft_ms"]["passed"] is (code == 0)
    assert TTFT_S * 1e3 <= verdicts["median_ttft_ms"]["value"] < TTFT_S * 1e3 + 60
    assert verdicts["scaling"]["passed"] and verdicts["failed"]["value"] == 0
    markdown = (report / "report.md").read_text()
    assert ("**PASS**" in markdown) is (code == 0) and ("**FAIL**" in markdown) is (code == 1)


def test_thresholds_for_another_model_give_no_verdict(serve_app, tmp_path):
    url = serve_app(scripted_app())
    suite = tmp_path / "suite.toml"
    text = Path(scripted_suite(tmp_path, 1000.0)).read_text()
    suite.write_text(text.replace("'scripted'", "'x'"))
    report = tmp_path / "report"
    argv = ["bench", "certify", "--base-url", url, "--report", str(report), "--suite", str(suite)]
    assert main([*argv, "--tokenizer", str(demo.ensure_checkpoint())]) == 2
    doc = json.loads((report / "certify.json").read_text())
    assert not doc["thresholds_apply"]
    assert "for model x, not scripted" in doc["no_thresholds_because"]


def test_unknown_checks_and_boxes_are_clear_errors(tmp_path, capsys):
    argv = ["bench", "certify", "--report", str(tmp_path), "--base-url", "http://127.0.0.1:9"]
    assert main([*argv, "--checks", "decode_b1,nope"]) == 2
    assert "no check nope" in capsys.readouterr().err
    assert main([*argv, "--box", "nope"]) == 2
    assert "has no such box" in capsys.readouterr().err


def test_certify_starts_met_serve_and_reads_its_prefix_cache(tmp_path, monkeypatch):
    """The whole command on a real server it starts itself: the random demo model, a check
    whose prompts share a prefix; the server's own /metrics say its cache served them."""
    monkeypatch.setenv("METRALE_DEMO", "random")
    suite = tmp_path / "suite.toml"
    suite.write_text(
        "[[check]]\nname = 'prefix_cache'\ntitle = 'shared prefixes'\n"
        "baseline = ['--input-len', '80', '--output-len', '4', '--ignore-eos', "
        "'--num-prompts', '6', '--max-concurrency', '1', '--seed', '7']\n"
        "args = ['--dataset', 'prefix', '--prefix-len', '64', '--input-len', '16', "
        "'--prefix-num-groups', '2', '--output-len', '4', '--ignore-eos', "
        "'--num-prompts', '6', '--max-concurrency', '1']\n"
        "measure = ['prefix_cache_hit_rate', 'ttft_speedup']\n"
        "[[box]]\nname = 'here'\nmatch = { min_cores = 1 }\nmodel = 'metrale-demo'\n"
        "serve_args = ['--max-seq-len', '512']\n"
        "[box.thresholds]\nprefix_cache = { min_prefix_cache_hit_rate = 0.5 }\n"
    )
    report = tmp_path / "report"
    code = main(["bench", "certify", "--suite", str(suite), "--report", str(report)])
    doc = json.loads((report / "certify.json").read_text())
    assert code == 0, doc["verdicts"]
    assert doc["serve_args"] == ["--max-seq-len", "512"] and doc["model"] == "metrale-demo"
    (entry,) = doc["checks"]
    # 6 prompts in 2 groups (and the warm-up, a copy of the first): the 4 later ones find
    # their group's 64 tokens cached
    assert entry["values"]["prefix_cache_hit_rate"] >= 4 * 64 / (6 * 80)
    (run,) = entry["runs"]["targets"][0]["runs"]
    for latency in ("ttft", "tpot", "itl", "e2el"):  # the server's histograms were read
        assert run[f"server_mean_{latency}_ms"] > 0
    assert "**PASS**" in (report / "report.md").read_text()
    assert (report / "serve.log").stat().st_size > 0  # the server's output, kept
