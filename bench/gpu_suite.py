"""The GPU benchmark suite (issue B1/B2/B3/B5), on random weights of real shapes.

Each run measures, in the same process: the device's copy bandwidth (a 4 GiB device-to-device
copy, read + write counted) and a large bf16 matrix-vector product's read bandwidth; the
roofline of B1 from them; and transformers `generate` on the same requests as the reference
(B3: the first 256 of them, as many as its dynamic cache holds; B5: the 0%-shared workload).
Results go to $OUT (or bench/results) as JSON with git SHA, device and versions.

    python bench/gpu_suite.py b1 b2 b3 b3_swap b5 [--scheduler-config sync|async]
        [--kv-cache-dtype auto|fp8]
        [--b2-models qwen3_0.6b llama_8b] [--max-cuda-graph-batch N] [--max-cuda-graph-tokens N]
        [--no-transformers]
        [--out DIR]

B1 runs under both schedulings; the others under `--scheduler-config` (default async).
`--kv-cache-dtype fp8` stores the KV cache in fp8 (e4m3) for every engine of the run.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec
import torch
from gc_pauses import GcPauses
from hf_reference import left_padded
from provenance import git_sha, metrale_tree
from workload_floor import Device, ModelCosts, StepTrace, describe, matmul_flops, report

from metrale.engine.core import EngineCore
from metrale.engine.heap import freeze_startup_heap
from metrale.engine.messages import EngineRequest
from metrale.engine_args import EngineArgs
from metrale.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parent
# Engine flags every benchmark shares, set from the command line.
ENGINE_FLAGS = {"scheduler_config": "async", "kv_cache_dtype": "auto"}
# B3's host pool with swap: more than the ~170k tokens (21 GiB of bf16 KV) the device lacks.
B3_SWAP_SPACE_GB = 48
# Off with --no-transformers: a quick re-measure of our side only (the record needs them).
RUN_TRANSFORMERS = True

LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
    "rope_theta": 500000.0,
    "torch_dtype": "bfloat16",
    "eos_token_id": [128001, 128009],
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
}
QWEN3_06B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": True,
    "rope_theta": 1000000.0,
    "torch_dtype": "bfloat16",
    "eos_token_id": 151645,
}


def model_dir(config: dict) -> str:
    path = Path(tempfile.mkdtemp(prefix="bench-model-"))
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def engine(config: dict, **kwargs) -> EngineCore:
    args = EngineArgs(
        model_from_path=model_dir(config),
        load_format="dummy",
        **({"dtype": "bfloat16"} | ENGINE_FLAGS | kwargs),
    )
    core = EngineCore.from_config(args.create_config(), progress=False)
    freeze_startup_heap()  # as `met serve`'s engine and `LLM` keep it; `release` thaws it
    return core


def add_requests(core: EngineCore, prompts: list[list[int]], params: list[SamplingParams]) -> None:
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        core.add_request(EngineRequest(f"r{time.monotonic_ns()}-{i}", prompt, p, 0.0))


def run(
    core: EngineCore, prompts: list[list[int]], params: list[SamplingParams]
) -> tuple[float, int]:
    """Wall seconds and output tokens for the whole batch."""
    add_requests(core, prompts, params)
    torch.cuda.synchronize()
    start = time.perf_counter()
    num_tokens = 0
    while core.has_unfinished_requests():
        num_tokens += sum(len(o.new_token_ids) for o in core.step())
    torch.cuda.synchronize()
    return time.perf_counter() - start, num_tokens


def run_traced(
    core: EngineCore, prompts: list[list[int]], params: list[SamplingParams], results: dict
) -> tuple[float, int, dict]:
    """`run`, with each step recorded: also the run's floor on this device (`workload_floor`),
    from the bandwidth and matmul rate measured at the start of the call."""
    add_requests(core, prompts, params)
    torch.cuda.synchronize()
    pauses = GcPauses()
    start = time.perf_counter()
    num_tokens = 0
    with StepTrace(core) as trace:
        while core.has_unfinished_requests():
            num_tokens += sum(len(o.new_token_ids) for o in trace.step())
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    pauses.close()
    bw = results["bandwidth"]
    floor = report(
        trace.steps,
        ModelCosts.of(core),
        Device(bw["read_bytes_per_s"], bw["matmul_flops_per_s"]),
        trace.wall_s,
    )
    floor["gc_s"] = pauses.seconds  # of the run's seconds, in Python's garbage collector
    print(describe(floor), f"({pauses.seconds:.3f} s in the garbage collector)")
    return seconds, num_tokens, floor


def release(core: EngineCore) -> None:
    """Give an engine's GPU memory back before the next one sizes its KV pool."""
    core.runner.graphs = None
    core.runner.kv_cache = None
    for layer in core.runner.model.attention_layers():
        layer.bind_cache(torch.empty(0), torch.empty(0))
    core.runner.model = None
    gc.unfreeze()
    gc.collect()
    torch.cuda.empty_cache()


def device_ms(events) -> float:
    """Milliseconds of GPU work (kernels, copies) in a profile's `key_averages()`. Only device
    events count: a torch op's row repeats the time of the kernels it launched (aten::mm and
    its cuBLAS kernels), which summing every row counted twice."""
    cuda = torch.autograd.DeviceType.CUDA
    return sum(e.self_device_time_total for e in events if e.device_type == cuda) / 1000


def step_ms(core: EngineCore, num_steps: int) -> float:
    """Wall milliseconds per engine step over the next `num_steps`, unprofiled."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(num_steps):
        core.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / num_steps * 1000


@dataclass
class StepProfile:
    wall_ms: float  # per step, under the profiler (which slows the host's launches)
    kernel_ms: float  # GPU work per step
    table: str  # the kernels, most time first
    host: str  # with host=True: the host's functions, most time first
    idle_ms: float  # per step: the device doing nothing between its first and last work
    gaps: str  # the longest of those idle stretches, with the work on each side


def profile_steps(core: EngineCore, num_steps: int, rows: int, host: bool = False) -> StepProfile:
    """The next `num_steps` engine steps under torch's profiler (and cProfile with `host`)."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    host_profile = cProfile.Profile()
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        if host:
            host_profile.enable()
        for _ in range(num_steps):
            core.step()
        torch.cuda.synchronize()
        host_profile.disable()
    wall_ms = (time.perf_counter() - start) / num_steps * 1000
    events = prof.key_averages()
    host_text = io.StringIO()
    if host:
        pstats.Stats(host_profile, stream=host_text).sort_stats("tottime").print_stats(25)
    idle_ms, gaps = device_gaps(prof.events())
    return StepProfile(
        wall_ms,
        device_ms(events) / num_steps,
        events.table(sort_by="self_cuda_time_total", row_limit=rows),
        host_text.getvalue(),
        idle_ms / num_steps,
        gaps,
    )


def device_gaps(events, shown: int = 15) -> tuple[float, str]:
    """Milliseconds the device sat idle between its first and last work (kernels and copies on
    any stream) in a profile's events, and its `shown` longest idle stretches, each with the
    work that ended before it and the work that began after it."""
    cuda = torch.autograd.DeviceType.CUDA
    work = sorted(
        (e.time_range.start, e.time_range.end, e.name) for e in events if e.device_type == cuda
    )
    if not work:
        return 0.0, ""
    gaps = []
    busy_until, last = work[0][1], work[0][2]
    for start, end, name in work[1:]:
        if start > busy_until:
            gaps.append((start - busy_until, last, name))
        if end > busy_until:
            busy_until, last = end, name
    idle_us = sum(g for g, _, _ in gaps)
    span_us = busy_until - work[0][0]
    lines = [f"device idle {idle_us / 1e3:.2f} of {span_us / 1e3:.2f} ms ({len(gaps)} gaps)"]
    for gap, before, after in sorted(gaps, reverse=True)[:shown]:
        lines.append(f"{gap:9.1f} us  after {before[:60]}  before {after[:60]}")
    return idle_us / 1e3, "\n".join(lines)


def profile(results: dict) -> None:
    """Where a batch-1 decode step of the 8B shape spends its time, kernel by kernel: eager,
    and replayed from CUDA graphs (whose kernel sum against the step's wall time shows the
    gaps between kernels)."""
    for eager in (True, False):
        mode = "eager" if eager else "graphs"
        core = engine(
            LLAMA_8B,
            max_seq_len=2048,
            max_num_seqs=8,
            gpu_memory_utilization=0.85,
            enforce_eager=eager,
        )
        prompt = torch.randint(0, 128000, (128,)).tolist()
        params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
        core.add_request(EngineRequest("p", prompt, params, 0.0))
        for _ in range(8):
            core.step()
        wall_ms = step_ms(core, 20)
        prof = profile_steps(core, 5, rows=30)
        out = Path(os.environ.get("OUT", ROOT / "results")) / f"profile_b1_{mode}.txt"
        out.write_text(
            f"{mode} decode step: {wall_ms:.3f} ms wall, {prof.kernel_ms:.3f} ms of kernels\n\n"
            f"{prof.table}\n"
        )
        results[f"profile_b1_{mode}"] = {
            "ms_per_step": wall_ms,
            "kernel_ms_per_step": prof.kernel_ms,
        }
        print(f"{mode} B1 step {wall_ms:.3f} ms, kernels {prof.kernel_ms:.3f} ms; profile in {out}")
        release(core)


def profile_b3(results: dict) -> None:
    """B3's steps, kernel by kernel: one while prompts are prefilled (16k-token chunks beside
    the decodes), one at a 512-request decode; then the run is abandoned."""
    core, prompts = b3_engine_and_prompts()
    params = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        core.add_request(EngineRequest(f"p{i}", prompt, params, 0.0))
    for phase, skip in (("prefill", 3), ("decode", 60)):
        profile_phase(core, f"b3_{phase}", skip, results)
    release(core)


def profile_b2(results: dict) -> None:
    """B2's steps (Qwen3-0.6B shape, sampled, seeded) kernel by kernel: a step with prompt
    tokens (8,192 of them, beside the decodes of the prompts already in) from the third on, then
    a decode step of 256 rows once every prompt is in; then the run is abandoned."""
    core = b2_engine(QWEN3_06B)
    prompts, _, params = b2_workload()
    run(core, prompts[:4], [SamplingParams(max_tokens=8)] * 4)
    add_requests(core, prompts, params)
    profile_phase(core, "b2_prefill", 2, results)  # its 9 steps fall in the first 17
    profile_phase(core, "b2_decode", 50, results)
    release(core)


def profile_phase(core: EngineCore, label: str, skip: int, results: dict) -> None:
    """After `skip` more steps: three steps' wall time, then three under the profiler, whose
    kernel table goes to `profile_{label}.txt`."""
    out_dir = Path(os.environ.get("OUT", ROOT / "results"))
    for _ in range(skip):
        core.step()
    # Unprofiled first: the profiler slows the host's launches, so its wall time may show
    # the GPU waiting on a host that is not slow without it.
    wall_ms = step_ms(core, 3)
    prof = profile_steps(core, 3, rows=25)
    batch = [
        len(core.scheduler.running),
        sum(r.num_computed_tokens for r in core.scheduler.running),
    ]
    host = profile_steps(core, 3, rows=25, host=True).host  # apart: cProfile slows the host
    (out_dir / f"profile_{label}.txt").write_text(
        f"{label} step: {wall_ms:.2f} ms wall ({prof.wall_ms:.2f} ms profiled), "
        f"{prof.kernel_ms:.2f} ms of kernels, the device idle {prof.idle_ms:.2f} ms; {batch[0]} "
        f"running requests, {batch[1]} computed tokens\n\n{prof.table}\n\n{prof.gaps}\n\n"
        f"The host over three more steps (under cProfile):\n{host}\n"
    )
    results[f"profile_{label}"] = {
        "ms_per_step": wall_ms,
        "profiled_ms_per_step": prof.wall_ms,
        "kernel_ms_per_step": prof.kernel_ms,
        "idle_ms_per_step": prof.idle_ms,
    }
    print(
        f"{label}: {wall_ms:.2f} ms per step, kernels {prof.kernel_ms:.2f} ms, idle "
        f"{prof.idle_ms:.2f} ms, {batch}"
    )


def profile_b5(results: dict) -> None:
    """Where B5's 75%-shared run spends its time, cache off and on: each step's wall time and
    what it computed (prompt tokens, decode rows; sync scheduling, so a step is timed alone),
    and the kernels of the whole run. The runs before (the 2,048 against 8,192-token prefill
    budget) are in bench/results/profile_b5_prefill*-2026-12-01.txt."""
    out_dir = Path(os.environ.get("OUT", ROOT / "results"))
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)] * 64
    for caching in (False, True):
        name = "cache" if caching else "nocache"
        core = engine(
            QWEN3_06B,
            max_seq_len=4096,
            max_num_seqs=64,
            enable_prefix_caching=caching,
            gpu_memory_utilization=0.5,
            scheduler_config="sync",
        )
        run(core, b5_workload(0.75, seed=1), params)
        seconds = run(core, b5_workload(0.75, seed=2), params)[0]
        steps = timed_steps(core, b5_workload(0.75, seed=3), params)
        for i, prompt in enumerate(b5_workload(0.75, seed=4)):
            core.add_request(EngineRequest(f"profiled-{i}", prompt, params[i], 0.0))
        prof = profile_steps(core, len(steps), rows=25)
        lines = [f"{n_prompt:6d} {n_decode:4d} {ms:8.2f}" for n_prompt, n_decode, ms in steps]
        total = sum(ms for _, _, ms in steps)
        decode_only = sum(ms for n_prompt, _, ms in steps if n_prompt == 0)
        (out_dir / f"profile_b5_shared75_{name}.txt").write_text(
            f"B5 75% shared, prefix cache {'on' if caching else 'off'} (sync scheduling): run "
            f"{seconds:.3f} s; timed steps {total:.1f} ms, of which decode-only steps "
            f"{decode_only:.1f} ms; profiled run {prof.kernel_ms * len(steps):.1f} ms of "
            f"kernels\n\nprompt tokens, decode rows, ms of each step:\n"
            + "\n".join(lines)
            + f"\n\n{prof.table}\n"
        )
        results[f"profile_b5_shared75_{name}"] = {
            "run_seconds": seconds,
            "steps": steps,
            "step_ms_total": total,
            "decode_only_ms": decode_only,
            "kernel_ms_total": prof.kernel_ms * len(steps),
        }
        print(
            f"B5 75% {name}: run {seconds:.3f} s, {len(steps)} steps {total:.1f} ms "
            f"(decode-only {decode_only:.1f} ms), kernels {prof.kernel_ms * len(steps):.1f} ms"
        )
        while core.has_unfinished_requests():
            core.step()
        release(core)


def timed_steps(
    core: EngineCore, prompts: list[list[int]], params: list[SamplingParams]
) -> list[tuple[int, int, float]]:
    """(prompt tokens, decode rows, wall ms) of each engine step that runs the requests."""
    schedule = core.scheduler.schedule
    shapes = []

    def recording_schedule():
        scheduled = schedule()
        n_prompt = sum(c.num_tokens for c in scheduled.chunks if c.num_tokens > 1)
        shapes.append((n_prompt, sum(c.num_tokens == 1 for c in scheduled.chunks)))
        return scheduled

    core.scheduler.schedule = recording_schedule
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        core.add_request(EngineRequest(f"timed-{i}", prompt, p, 0.0))
    times = []
    while core.has_unfinished_requests():
        torch.cuda.synchronize()
        start = time.perf_counter()
        core.step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1000)
    core.scheduler.schedule = schedule
    return [(*shape, ms) for shape, ms in zip(shapes, times, strict=True)]


def bandwidth() -> dict[str, float]:
    src = torch.empty(2**31, dtype=torch.bfloat16, device="cuda").normal_()  # 4 GiB
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    copy = 2 * src.numel() * 2 * 10 / (time.perf_counter() - t)
    del src, dst
    w = torch.randn(28672 * 2, 4096, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(1, 4096, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        x @ w.t()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(50):
        x @ w.t()
    torch.cuda.synchronize()
    gemv = w.numel() * 2 * 50 / (time.perf_counter() - t)
    return {
        "copy_bytes_per_s": copy,
        "gemv_read_bytes_per_s": gemv,
        "read_bytes_per_s": max(copy, gemv),
        "matmul_flops_per_s": matmul_flops(),
    }


# transformers' reference runs padded batches of at most this many requests: B3's 256 x 2,000
# tokens of dynamic cache (64 GB) fit beside the 16 GB of weights, 1,000 requests would not.
HF_BATCH = 256


def hf_model(config: dict, device: str = "cuda") -> torch.nn.Module:
    """The transformers model of a benchmark config: random bf16 weights, EOS off."""
    import transformers

    classes = {
        "LlamaForCausalLM": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "Qwen3ForCausalLM": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }
    config_cls, model_cls = classes[config["architectures"][0]]
    skip = ("architectures", "model_type", "torch_dtype")
    hf_config = config_cls(**{k: v for k, v in config.items() if k not in skip})
    with torch.device(device):
        model = model_cls(hf_config).to(torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    return model


def hf_rate(model: torch.nn.Module, prompts: list[list[int]], output_lens: list[int]) -> float:
    """transformers `generate` over the requests in left-padded batches of HF_BATCH, greedy:
    output tokens per second, counting only the tokens each request asked for (a batch decodes
    until its longest request is done)."""
    seconds = 0.0
    for start in range(0, len(prompts), HF_BATCH):
        batch, lens = prompts[start : start + HF_BATCH], output_lens[start : start + HF_BATCH]
        ids, mask = left_padded(batch)
        n = max(lens)
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        begin = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                ids.to(model.device),
                attention_mask=mask.to(model.device),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        seconds += time.perf_counter() - begin
    return sum(output_lens) / seconds


def add_hf_reference(entry: dict, config: dict, prompts: list[list[int]], lens: list[int]) -> None:
    """Run transformers on the same requests (after our engine is released) and record the
    ratio. It decodes greedily where a benchmark samples: the forward passes are the cost."""
    if not RUN_TRANSFORMERS:
        return
    model = hf_model(config)
    rate = hf_rate(model, prompts, lens)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    entry["hf_output_tokens_per_s"] = rate
    entry["hf_requests"] = len(prompts)
    entry["vs_hf"] = entry["output_tokens_per_s"] / rate
    print(
        f"  transformers on {len(prompts)} of the requests: {rate:.0f} tok/s; ours/hf = "
        f"{entry['vs_hf']:.1f}x"
    )


def b1_rates(core: EngineCore, prompt: list[int], repeats: int = 3) -> list[float]:
    """Batch-1 decode tokens/s of `prompt`, `repeats` times: 513 greedy tokens less the time of
    1 (its prefill), after a warm-up."""

    def params(n: int) -> list[SamplingParams]:
        return [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)]

    run(core, [prompt], params(8))
    times = []
    for _ in range(repeats):
        t_long, _ = run(core, [prompt], params(513))
        t_short, _ = run(core, [prompt], params(1))
        times.append(512 / (t_long - t_short))
    return times


def b1(results: dict) -> None:
    """Batch-1 decode, Llama-3.1-8B shape, prompt 128, 512 output tokens."""
    bw = results["bandwidth"]
    prompt = torch.randint(0, 128000, (128,)).tolist()

    for scheduling in ("sync", "async"):
        core = engine(
            LLAMA_8B,
            max_seq_len=2048,
            max_num_seqs=8,
            gpu_memory_utilization=0.85,
            scheduler_config=scheduling,
        )
        times = b1_rates(core, prompt)
        ours = sorted(times)[1]
        cfg = core.config.model
        weights = (
            sum(
                p.numel() * p.element_size()
                for n, p in core.runner.model.named_parameters()
                if "embed_tokens" not in n
            )
            + cfg.hidden_size * 2
        )
        kv_bytes = core.config.cache.dtype.itemsize
        kv_per_token = 2 * cfg.num_layers * cfg.kv_size * kv_bytes * (128 + 256)  # mean context
        roofline = bw["read_bytes_per_s"] / (weights + kv_per_token)
        results["b1" if scheduling == "async" else "b1_sync"] = {
            "tokens_per_s": ours,
            "runs": times,
            "roofline_tokens_per_s": roofline,
            "fraction_of_roofline": ours / roofline,
            "cuda_graphs": core.runner.graphs is not None,
            "scheduling": scheduling,
        }
        print(
            f"B1 {scheduling}: {ours:.1f} tok/s, roofline {roofline:.1f}, "
            f"{100 * ours / roofline:.1f}%"
        )
        release(core)
    if not RUN_TRANSFORMERS:
        return
    hf = hf_model(LLAMA_8B)
    ids = torch.tensor([prompt], device="cuda")

    def hf_seconds(n: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    hf_seconds(4)
    t_long, t_short = hf_seconds(129), hf_seconds(1)
    hf_rate = 128 / (t_long - t_short)
    results["b1"]["hf_tokens_per_s"] = hf_rate
    results["b1"]["vs_hf"] = ours / hf_rate
    print(f"B1 transformers: {hf_rate:.1f} tok/s; ours/hf = {ours / hf_rate:.1f}x")


def b1_spec(results: dict) -> None:
    """B1 (8B shape, async) without and with `--speculative-config ngram`, in one call. Random
    weights repeat nothing, so drafts never pay: what speculation costs a request it cannot
    help (the lookups, the waits for the step before, the pauses that end them)."""
    prompt = torch.randint(0, 128000, (128,)).tolist()
    variants = {"plain": {}, "ngram": {"speculative_config": "ngram"}}
    rates: dict[str, list[float]] = {name: [] for name in variants}
    for name, flags in variants.items():
        core = engine(LLAMA_8B, max_seq_len=2048, max_num_seqs=8, **flags)
        rates[name] += b1_rates(core, prompt, repeats=3)
        release(core)
    plain, ngram = (sorted(rates[n])[len(rates[n]) // 2] for n in variants)
    results["b1_spec"] = {"runs": rates, "plain": plain, "ngram": ngram, "ratio": ngram / plain}
    print(f"B1 spec: plain {plain:.1f}, ngram {ngram:.1f} tok/s ({ngram / plain:.3f}x)")


B2_MODELS = {"qwen3_0.6b": QWEN3_06B, "llama_8b": LLAMA_8B}


def b2_workload(**knobs) -> tuple[list[list[int]], list[int], list[SamplingParams]]:
    """B2's 256 prompts (seed 0), their output lengths, and their sampling (temperature 0.6,
    request i seeded with i; `knobs` added to every request's, or replacing: `seed=None`)."""
    g = torch.Generator().manual_seed(0)
    lens_in = torch.randint(100, 1025, (256,), generator=g).tolist()
    lens_out = torch.randint(100, 1025, (256,), generator=g).tolist()
    prompts = [torch.randint(0, 10000, (n,), generator=g).tolist() for n in lens_in]
    params = [
        SamplingParams(
            **{"temperature": 0.6, "max_tokens": n, "ignore_eos": True, "seed": i} | knobs
        )
        for i, n in enumerate(lens_out)
    ]
    return prompts, lens_out, params


def b2_engine(config: dict, **kwargs) -> EngineCore:
    """B2's engine: 256 sequences at once, 8k-token prefill chunks."""
    return engine(
        config,
        max_seq_len=4096,
        max_num_seqs=256,
        max_prefill_tokens=8192,
        gpu_memory_utilization=0.85,
        **kwargs,
    )


def b2_knobs(results: dict) -> None:
    """B2 (Qwen3-0.6B) with llama.cpp's samplers, DRY and the LZ penalty on every request against
    none, in one engine: what a batch that uses them pays."""
    from metrale.sampling_params import DryBreakers

    # DRY's breakers as the frontend resolves llama.cpp's defaults on a real vocabulary: a few
    # thousand single-token breakers (here every 40th id of Qwen3's 152k), no sequences.
    dry = {"dry_multiplier": 0.8, "dry_breakers": DryBreakers(single=tuple(range(0, 151_936, 40)))}
    core = b2_engine(QWEN3_06B)
    prompts, _, _ = b2_workload()
    run(core, prompts[:4], [SamplingParams(max_tokens=8)] * 4)
    variants = {
        "none": {},
        "top_n_sigma": {"top_n_sigma": 1.0},
        "dry": dry,
        "dry_top_n_sigma": {**dry, "top_n_sigma": 1.0},
        "lz": {"lz_penalty": 0.15},
        "none_again": {},
    }
    for name, knobs in variants.items():
        _, _, params = b2_workload(**knobs)
        seconds, tokens = run(core, prompts, params)
        shown = {k: v for k, v in knobs.items() if k != "dry_breakers"}
        results[f"b2_knobs_{name}"] = {"output_tokens_per_s": tokens / seconds, "knobs": shown}
        print(f"B2 qwen3_0.6b knobs {name}: {tokens / seconds:.0f} output tok/s")
    release(core)


def b2(results: dict, models: tuple[str, ...] = tuple(B2_MODELS)) -> None:
    """nano-vllm's benchmark: 256 sequences, input and output lengths U[100, 1024].

    transformers takes 3-5 minutes per model on the H200 here (a padded batch of 256 decodes
    1,024 steps), so one device call of 10 minutes holds one model's run (`--b2-models`)."""
    for name in models:
        config = B2_MODELS[name]
        core = b2_engine(config)
        prompts, lens_out, params = b2_workload()
        run(core, prompts[:4], [SamplingParams(max_tokens=8)] * 4)
        seconds, tokens, floor = run_traced(core, prompts, params, results)
        results[f"b2_{name}"] = {
            "output_tokens_per_s": tokens / seconds,
            "seconds": seconds,
            "output_tokens": tokens,
            "floor": floor,
        }
        print(f"B2 {name}: {tokens / seconds:.0f} output tok/s ({tokens} in {seconds:.1f} s)")
        release(core)
        add_hf_reference(results[f"b2_{name}"], config, prompts, lens_out)


def b2_spec(results: dict) -> None:
    """B2 (Llama-3.1-8B shape) without and with `--speculative-config ngram` (cost model on),
    alternating twice in one call: random weights never repeat, so drafts never pay; what
    speculation costs a large batch it cannot help."""
    variants = {"plain": {}, "ngram": {"speculative_config": "ngram"}}
    prompts, _, params = b2_workload()
    rates: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(2):
        for name, flags in variants.items():
            core = b2_engine(LLAMA_8B, **flags)
            run(core, prompts[:4], [SamplingParams(max_tokens=8)] * 4)
            seconds, tokens = run(core, prompts, params)
            rates[name].append(tokens / seconds)
            speculator = core.scheduler.speculator
            if speculator is not None:
                results.setdefault("b2_spec_drafts", []).append(
                    {
                        "draft_tokens": speculator.stats.num_draft_tokens,
                        "accepted_tokens": speculator.stats.num_accepted_tokens,
                        "priced_out": speculator.num_priced_out,
                        "bar": speculator.costs.describe() if speculator.costs else None,
                    }
                )
            print(f"B2 spec {name}: {tokens / seconds:.0f} output tok/s")
            release(core)
    plain, ngram = (statistics.median(rates[n]) for n in variants)
    results["b2_spec"] = {"runs": rates, "plain": plain, "ngram": ngram, "ratio": ngram / plain}
    print(f"B2 spec: plain {plain:.0f}, ngram {ngram:.0f} tok/s ({ngram / plain:.3f}x)")


def b3_engine_and_prompts(**kwargs) -> tuple[EngineCore, list[list[int]]]:
    """B3's engine (8B shape, 512 requests at once, 16k-token prefill chunks) and its 1000
    prompts of 1000 tokens (seed 0)."""
    core = engine(
        LLAMA_8B,
        max_seq_len=2048,
        max_num_seqs=512,
        max_prefill_tokens=16384,
        gpu_memory_utilization=0.9,
        **kwargs,
    )
    g = torch.Generator().manual_seed(0)
    return core, [torch.randint(0, 10000, (1000,), generator=g).tolist() for _ in range(1000)]


def b3(results: dict) -> None:
    """Offline throughput: 1000 requests of 1000 input and 1000 output tokens, 8B shape."""
    core, prompts = b3_engine_and_prompts()
    params = [SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)] * 1000
    run(core, prompts[:8], [SamplingParams(max_tokens=8)] * 8)
    seconds, tokens, floor = run_traced(core, prompts, params, results)
    results["b3_llama_8b"] = {
        "output_tokens_per_s": tokens / seconds,
        "seconds": seconds,
        "output_tokens": tokens,
        "floor": floor,
    }
    print(f"B3 llama_8b: {tokens / seconds:.0f} output tok/s ({tokens} in {seconds:.1f} s)")
    release(core)
    add_hf_reference(results["b3_llama_8b"], LLAMA_8B, prompts[:HF_BATCH], [1000] * HF_BATCH)


B3_PREEMPTION_MODES = {"recompute": {}, "swap": {"swap_space_gb": B3_SWAP_SPACE_GB}}


def b3_swap(results: dict, modes: tuple[str, ...] = tuple(B3_PREEMPTION_MODES)) -> None:
    """B3 with preempted requests swapped to host memory (`--swap-space-gb`, the costs measured
    at startup choosing per victim) against recompute only, in the same call."""
    params = [SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)] * 1000
    for name in modes:
        flags = B3_PREEMPTION_MODES[name]
        core, prompts = b3_engine_and_prompts(**flags)
        run(core, prompts[:8], [SamplingParams(max_tokens=8)] * 8)
        scheduler = core.scheduler
        before = scheduler.num_preemptions, scheduler.num_recomputed_tokens
        seconds, tokens, floor = run_traced(core, prompts, params, results)
        entry = {
            "output_tokens_per_s": tokens / seconds,
            "seconds": seconds,
            "output_tokens": tokens,
            "floor": floor,
            "preemptions": scheduler.num_preemptions - before[0],
            "recomputed_tokens": scheduler.num_recomputed_tokens - before[1],
        }
        if scheduler.swap is not None:
            entry["swap"] = msgspec.structs.asdict(scheduler.swap.stats())
        results[f"b3_{name}"] = entry
        print(
            f"B3 {name}: {entry['output_tokens_per_s']:.0f} output tok/s ({tokens} in "
            f"{seconds:.1f} s), {entry['preemptions']} preemptions, "
            f"{entry['recomputed_tokens']} tokens recomputed, swap {entry.get('swap')}"
        )
        release(core)


def b5_workload(shared: float, seed: int) -> list[list[int]]:
    """64 prompts of 2,048 tokens whose first `shared` of tokens are the same."""
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, 10000, (int(2048 * shared),), generator=g).tolist()
    return [
        prefix + torch.randint(0, 10000, (2048 - len(prefix),), generator=g).tolist()
        for _ in range(64)
    ]


def b5(results: dict) -> None:
    """Prefix caching: 2048-token prompts sharing 0% or 75% of their tokens, cache on and off.

    Both engines live side by side and the timed runs alternate between them (off, on, off,
    ...), so drift of the shared machine falls on both alike; each first runs a workload of the
    same shape from another seed, so that every kernel variant is compiled before the timed
    runs. The timed runs use fresh seeds, so with caching only each run's own shared prefix is
    reused. Medians of seven.
    """

    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)] * 64
    for shared in (0.0, 0.75):
        # The second engine's share counts the first one's memory as used: 0.8 leaves it ~0.4.
        cores = {
            caching: engine(
                QWEN3_06B,
                max_seq_len=4096,
                max_num_seqs=64,
                enable_prefix_caching=caching,
                gpu_memory_utilization=utilization,
            )
            for caching, utilization in ((False, 0.4), (True, 0.8))
        }
        runs: dict[bool, list[float]] = {False: [], True: []}
        for core in cores.values():
            run(core, b5_workload(shared, seed=1), params)
        for seed in range(10, 17):
            for caching, core in cores.items():
                runs[caching].append(run(core, b5_workload(shared, seed=seed), params)[0])
        for caching, core in cores.items():
            seconds = sorted(runs[caching])[len(runs[caching]) // 2]
            key = f"b5_shared{int(shared * 100)}_{'cache' if caching else 'nocache'}"
            results[key] = {
                "seconds": seconds,
                "runs": runs[caching],
                "prompt_tokens_per_s": 64 * 2048 / seconds,
            }
            print(f"B5 {key}: {seconds:.3f} s")
            release(core)
    if RUN_TRANSFORMERS:  # the reference: a 0%-shared workload (it has no prefix cache)
        model = hf_model(QWEN3_06B)
        seconds = 64 * 8 / hf_rate(model, b5_workload(0.0, seed=10), [8] * 64)
        del model
        results["b5_hf"] = {"seconds": seconds, "prompt_tokens_per_s": 64 * 2048 / seconds}
        print(f"B5 transformers, 0% shared: {seconds:.3f} s")
    for shared in (0, 75):
        off = results[f"b5_shared{shared}_nocache"]["seconds"]
        on = results[f"b5_shared{shared}_cache"]["seconds"]
        results[f"b5_shared{shared}_speedup"] = off / on
        print(f"B5 shared {shared}%: cache on is {off / on:.2f}x the speed of cache off")


def versions() -> dict[str, str]:
    import transformers
    import triton

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "triton": triton.__version__,
        "transformers": transformers.__version__,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "benchmarks",
        nargs="+",
        choices=[
            "b1",
            "b1_spec",
            "b2",
            "b2_knobs",
            "b2_spec",
            "b3",
            "b3_swap",
            "b5",
            "profile",
            "profile_b2",
            "profile_b3",
            "profile_b5",
        ],
    )
    parser.add_argument("--scheduler-config", choices=["sync", "async"], default="async")
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto")
    parser.add_argument("--max-cuda-graph-batch", type=int, help="default: the engine's")
    parser.add_argument(
        "--max-cuda-graph-tokens",
        type=int,
        help="steps with prompt tokens as piecewise CUDA graphs up to N tokens (default: the "
        "engine's); an A/B of them is two calls of the same tree, 0 and the step's budget",
    )
    parser.add_argument(
        "--no-transformers", action="store_true", help="skip the transformers references"
    )
    parser.add_argument("--b2-models", nargs="+", choices=list(B2_MODELS), default=list(B2_MODELS))
    parser.add_argument(
        "--b3-modes",
        nargs="+",
        choices=list(B3_PREEMPTION_MODES),
        default=list(B3_PREEMPTION_MODES),
        help="b3_swap's runs, in order",
    )
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ROOT / "results")))
    args = parser.parse_args()
    global RUN_TRANSFORMERS
    RUN_TRANSFORMERS = not args.no_transformers
    ENGINE_FLAGS.update(scheduler_config=args.scheduler_config, kv_cache_dtype=args.kv_cache_dtype)
    if args.max_cuda_graph_batch is not None:
        ENGINE_FLAGS["max_cuda_graph_batch"] = args.max_cuda_graph_batch
    if args.max_cuda_graph_tokens is not None:
        ENGINE_FLAGS["max_cuda_graph_tokens"] = args.max_cuda_graph_tokens
    results: dict = {
        "date": datetime.date.today().isoformat(),
        "git_sha": git_sha(),
        "metrale_tree": metrale_tree(),
        "device": torch.cuda.get_device_name(),
        "versions": versions(),
        "scheduling": args.scheduler_config,
        "kv_cache_dtype": args.kv_cache_dtype,
        "engine_flags": ENGINE_FLAGS,
        "transformers": RUN_TRANSFORMERS,
    }
    # Every call records the machine's read bandwidth of the moment (B1's roofline uses it).
    results["bandwidth"] = bandwidth()
    print(f"copy bandwidth {results['bandwidth']['copy_bytes_per_s'] / 1e12:.2f} TB/s")
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"gpu_suite-{results['date']}.json"
    for name in args.benchmarks:
        try:
            if name == "b2":
                b2(results, args.b2_models)
            elif name == "b3_swap":
                b3_swap(results, args.b3_modes)
            else:
                globals()[name](results)
        except Exception as e:  # keep the other benchmarks' numbers
            results[f"{name}_error"] = f"{type(e).__name__}: {e}"
            print(f"{name} failed: {type(e).__name__}: {e}")
        # After each benchmark: a device call cut short at its time limit keeps the ones done.
        out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
