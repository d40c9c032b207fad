"""bench/workload_floor.py's `StepTrace` gives each step its own time: the device time the
runner measured for that step, paired with the shape the scheduler gave it, not the wall time
of the `step()` call that collected it (with async scheduling that call launched the next step
and waited for this one, so a prompt step's time fell on the decode step after it)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from metrale.engine.core import EngineCore
from metrale.engine.messages import EngineRequest
from metrale.engine_args import EngineArgs
from metrale.sampling_params import SamplingParams
from tests.conftest import build_checkpoint

sys.path.append(str(Path(__file__).resolve().parents[2] / "bench"))  # last: shadows nothing
from workload_floor import Device, ModelCosts, StepTrace, report


@pytest.mark.parametrize("scheduling", ["sync", "async"])
def test_each_step_gets_its_own_time_and_shape(tmp_path, scheduling):
    args = EngineArgs(
        model_from_path=str(build_checkpoint(tmp_path, "llama")),
        dtype="float32",
        device="cpu",
        scheduler_config=scheduling,
        max_num_batched_tokens=32,
        max_num_seqs=4,
        enforce_eager=True,
    )
    core = EngineCore.from_config(args.create_config(), progress=False)
    assert core.config.async_scheduling == (scheduling == "async")
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for i, n in enumerate((50, 7, 20)):
        core.add_request(
            EngineRequest(f"r{i}", list(range(100 * i + 3, 100 * i + 3 + n)), params, 0.0)
        )
    core.step_stats.clear()
    with StepTrace(core) as trace:
        while core.has_unfinished_requests():
            trace.step()
    stats = [s for s in core.step_stats if s.num_tokens]
    steps = [s for s in trace.steps if s.prompt_tokens + s.decode_rows]
    # In the order the engine collected them, each with the runner's own time for it.
    assert [s.seconds for s in steps] == [s.device_s for s in stats]
    assert [s.prompt_tokens + s.decode_rows for s in steps] == [s.num_tokens for s in stats]
    assert steps[0].prompt_tokens == 32 and steps[0].decode_rows == 0
    assert sum(s.prompt_tokens for s in steps) == 77
    assert sum(s.sampled_rows for s in steps) == 3 * 6
    floor = report(trace.steps, ModelCosts.of(core), Device(1e11, 1e12), trace.wall_s)
    assert sum(k["steps"] for k in floor["by_kind"].values()) == len(trace.steps)
    assert 0 < floor["step_s"] <= floor["wall_s"] == trace.wall_s
    assert floor["host_bound_s"] == pytest.approx(floor["wall_s"] - floor["step_s"])
