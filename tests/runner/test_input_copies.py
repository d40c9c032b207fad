"""A step's pinned input buffers are free again once its copies are queued, before its forward:
the runner records the inputs' event (which the next step's fill waits on) after the step's
inputs and the sampler's are copied and before the forward is queued. Recorded after the
forward, as it was, the next step's fill waited for this step's forward to end, so with async
scheduling the device idled for the host's whole fill each step.

On a GPU, tests/gpu/test_engine_on_gpu.py checks the event fires while the forward still runs.
"""

from __future__ import annotations

from metrale import LLM, SamplingParams
from tests.conftest import build_checkpoint


def test_the_inputs_event_is_recorded_before_the_forward(tmp_path):
    llm = LLM(
        model_from_path=str(build_checkpoint(tmp_path, "llama")),
        dtype="float32",
        enforce_eager=True,
        max_num_batched_tokens=16,
        max_num_seqs=4,
    )
    runner = llm.engine.runner
    calls: list[str] = []
    record, prepare = runner._record_inputs_copied, runner.sampling.prepare

    def recording_record() -> None:
        calls.append("copied")
        record()

    def recording_prepare(*args, **kwargs):
        calls.append("sampler inputs")
        return prepare(*args, **kwargs)

    runner._record_inputs_copied = recording_record
    runner.sampling.prepare = recording_prepare
    hook = runner.model.register_forward_pre_hook(lambda *_: calls.append("forward"))
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    # A 40-token prompt in 16-token chunks: two steps that sample nothing, then steps that do.
    llm.generate([list(range(5, 45)), list(range(7, 12))], params, use_tqdm=False)
    hook.remove()
    steps, step = [], []
    for call in calls:
        step.append(call)
        if call == "forward":
            steps.append(tuple(step))
            step = []
    assert step == []
    assert steps.count(("copied", "forward")) == 2
    assert steps.count(("sampler inputs", "copied", "forward")) == len(steps) - 2 >= 3
