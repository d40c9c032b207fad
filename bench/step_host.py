"""Where a B2 step's host time goes, with no profiler: each phase timed by a wrapper.

torch's profiler and cProfile slow the host's launches several times over, so their split of a
host-bound step (B2's steps with prompt tokens: 36.7 ms of wall time for 19.6 ms of kernels on
an H100) says little about the host without them. Here each phase of the engine's step (the
scheduler, the runner's inputs, the forward's modules and kernel launches, the sampler, the
collection) is wrapped by a `perf_counter` pair (~1 us a call), and each step's forward by CUDA
events, so a step's host time per phase stands beside its device time. Then two probes of what a
launch costs: a cuBLAS product whose row count is new each call against the same count, and one
Triton kernel.

    python bench/step_host.py [--steps 40] [--out DIR]     (a GPU; B2's engine, Qwen3-0.6B shape)
    python bench/step_host.py --tiny                        (any machine: a 2-layer model)
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import time
from pathlib import Path

import torch
import triton
from gpu_suite import QWEN3_06B, add_requests, b2_engine, b2_workload, engine, release
from phase_clock import PhaseClock
from provenance import git_sha, metrale_tree
from workload_floor import kind_of_scheduled

from metrale.engine.scheduler import Scheduler
from metrale.layers.attention import Attention
from metrale.layers.layernorm import RMSNorm
from metrale.layers.linear import Linear
from metrale.models.llama import DecoderMLP, LlamaForCausalLM
from metrale.runner import model_runner
from metrale.runner.model_runner import ModelRunner
from metrale.runner.sampling_inputs import SamplingInputs
from metrale.sampling_params import SamplingParams

TINY = QWEN3_06B | {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}


def instrument(clock: PhaseClock, core) -> None:
    phases = [
        (Scheduler, "schedule", "schedule"),
        (Scheduler, "update", "scheduler update"),
        (ModelRunner, "launch", "runner launch (all below)"),
        (ModelRunner, "_fill_inputs", "fill inputs"),
        (core.runner, "build_metadata", "attention metadata"),
        (SamplingInputs, "prepare", "sampler inputs"),
        (LlamaForCausalLM, "forward", "model forward (all below)"),
        (LlamaForCausalLM, "compute_logits", "logits"),
        (Linear, "forward", "linear"),
        (RMSNorm, "forward", "rms_norm"),
        (Attention, "forward", "attention"),
        (DecoderMLP, "forward", "mlp (its linears too)"),
        (model_runner, "sample", "sample"),
        (ModelRunner, "_copy_to_host", "copy to host"),
        (ModelRunner, "collect", "collect (waits for the device)"),
    ]
    for owner, attr, phase in phases:
        clock.wrap(owner, attr, phase)
    # JITFunction.run(self, *args, ...): a phase per kernel
    clock.wrap(triton.runtime.jit.JITFunction, "run", lambda args: f"triton {args[0].fn.__name__}")


def forward_events(device: torch.device) -> list:
    """Each eager forward's (start, end) CUDA events and its row count; graph replays are not
    forwards here."""
    pairs: list = []
    inner = LlamaForCausalLM.forward

    def timed(self, input_ids, *args, **kwargs):
        if device.type != "cuda" or torch.cuda.is_current_stream_capturing():  # a graph's
            return inner(self, input_ids, *args, **kwargs)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = inner(self, input_ids, *args, **kwargs)
        end.record()
        pairs.append((start, end, input_ids.shape[0]))
        return out

    LlamaForCausalLM.forward = timed
    return pairs


def step_kinds(core) -> list[str]:
    """The kind of each step the runner launches, in order (wraps `launch`), as
    `workload_floor` names them."""
    kinds: list[str] = []
    inner = core.runner.launch

    def launch(scheduled):
        kinds.append(kind_of_scheduled(scheduled))
        return inner(scheduled)

    core.runner.launch = launch
    return kinds


def traced_run(core, prompts, params, max_steps: int, clock: PhaseClock, events: list) -> dict:
    kinds = step_kinds(core)
    add_requests(core, prompts, params)
    sync = torch.cuda.synchronize if core.runner.device.type == "cuda" else lambda: None
    sync()
    clock.take()
    steps = []
    for _ in range(max_steps):
        if not core.has_unfinished_requests():
            break
        start = time.perf_counter()
        core.step()
        wall = time.perf_counter() - start
        seconds, calls = clock.take()
        steps.append({"wall_s": wall, "seconds": seconds, "calls": calls})
    sync()
    # Step i's call launches step i (async: and collects i - 1); label it by what it launched.
    by_kind: dict[str, list] = collections.defaultdict(list)
    for kind, step in zip(kinds, steps, strict=False):
        by_kind[kind].append(step)
    report = {}
    for kind, group in by_kind.items():
        names = sorted({n for s in group for n in s["seconds"]})
        report[kind] = {
            "steps": len(group),
            "wall_ms": statistics.median(s["wall_s"] for s in group) * 1e3,
            "phases_ms": {
                n: statistics.mean(s["seconds"].get(n, 0.0) for s in group) * 1e3 for n in names
            },
            "calls": {n: statistics.mean(s["calls"].get(n, 0) for s in group) for n in names},
        }
    forwards = [(s.elapsed_time(e), n) for s, e, n in events]
    if forwards:
        report["eager forwards (device ms, rows)"] = forwards[:40]
    while core.has_unfinished_requests():
        core.step()
    return report


def launch_probes(device: torch.device) -> dict:
    """Host microseconds a call: cuBLAS at a row count seen before against a new one each call
    (its algorithm choice is cached per shape), and the project's RMSNorm kernel."""
    from metrale.kernels.rms_norm import rms_norm

    if device.type != "cuda":
        return {}
    x = torch.randn(8448, 1024, device=device, dtype=torch.bfloat16)
    w = torch.randn(4096, 1024, device=device, dtype=torch.bfloat16)
    norm_w = torch.ones(1024, device=device, dtype=torch.bfloat16)

    def host_us(call, rows_list) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for rows in rows_list:
            call(rows)
        elapsed = time.perf_counter() - start
        torch.cuda.synchronize()
        return elapsed / len(rows_list) * 1e6

    def mm(rows):
        torch.nn.functional.linear(x[:rows], w)

    host_us(mm, [8317] * 5)
    probes = {
        "linear, the same rows": host_us(mm, [8317] * 40),
        "linear, new rows each call": host_us(mm, list(range(8200, 8240))),
        "linear, those rows again": host_us(mm, list(range(8200, 8240))),
        "rms_norm": host_us(lambda rows: rms_norm(x[:rows], norm_w, 1e-6), [8317] * 40),
    }
    for name, us in probes.items():
        print(f"{name:32s} {us:7.1f} us of host a call")
    return probes


def tiny_engine():
    """A 2-layer float32 model on whatever device there is."""
    return engine(
        TINY,
        dtype="float32",
        max_seq_len=2048,
        max_num_seqs=16,
        max_prefill_tokens=512,
        enforce_eager=True,  # the CPU's compiled decode would trace the wrappers
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model: a smoke run")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench/results")))
    args = parser.parse_args()
    clock = PhaseClock()
    core = tiny_engine() if args.tiny else b2_engine(QWEN3_06B)
    prompts, _, params = b2_workload()
    if args.tiny:
        prompts, params = prompts[:16], params[:16]
    add_requests(core, prompts[:4], [SamplingParams(max_tokens=8)] * 4)
    while core.has_unfinished_requests():  # kernels compiled, the allocator warm
        core.step()
    events = forward_events(core.runner.device)
    instrument(clock, core)
    report = traced_run(core, prompts, params, args.steps, clock, events)
    results = {
        "benchmark": "step_host",
        "git_sha": git_sha(),
        "metrale_tree": metrale_tree(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "steps": report,
        "launch_probes_us": launch_probes(core.runner.device),
    }
    release(core)
    for kind, r in report.items():
        if not isinstance(r, dict):
            continue
        print(f"\n{kind}: {r['steps']} steps, wall {r['wall_ms']:.2f} ms (median)")
        for name, ms in sorted(r["phases_ms"].items(), key=lambda kv: -kv[1]):
            print(f"  {name:36s} {ms:8.3f} ms  {r['calls'][name]:7.1f} calls")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "step_host.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
