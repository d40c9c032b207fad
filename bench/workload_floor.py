"""A workload's floor on this device, step by step, and where a run spends the time above it.

`StepTrace` records each engine step of a run: what it computed (prompt tokens, decode rows,
the context tokens its attention reads, the rows it samples) and its time. A step's floor is
the least time this device could take for that work:

    max(weights read once, matmul FLOPs at the measured rate) + KV bytes read at the bandwidth

with the matmuls' FLOPs counted as 2 x parameters per token (the head only for sampled rows)
plus a prompt's attention, 4 x context x heads x head_dim a token per layer; the KV read is
every decode row's whole context (and a prompt chunk's context once) in the cache's dtype.
A step's time is its own time on the device (`ModelRunnerOutput.device_s`, from the runner's
events, recorded when the engine collects the step; a GPU step that samples nothing has no
end event, so it counts apart, untimed): with async scheduling the wall time of a `step()`
call is step N+1's launch plus the wait for step N, so it would charge a long prompt step to
the decode step after it. The run's wall time is kept apart; what it holds beyond the steps'
device time is the device waiting on the host and the untimed steps (`host_bound_s`). Where
the engine keeps no step times (`--disable-log-stats`), each call's wall time stands for the
step it scheduled.

`report` sums the steps by kind (with prompt tokens, decode-only by batch size) and gives each
kind's device time, floor and what is lost above it; the run's fraction of the floor is its
floor over its wall time: what the issue's "fraction of the floor reached" means.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from metrale.engine.core import EngineCore


@dataclass(frozen=True)
class StepShape:
    prompt_tokens: int  # tokens of chunks that are not decodes
    decode_rows: int  # decode chunks (one token each, plus drafts)
    sampled_rows: int  # rows the head runs on
    kv_read_tokens: int  # context tokens the step's attention reads, all chunks together
    prompt_attention_tokens: int  # sum over prompt tokens of the context each attends to
    seconds: float  # on the device (or, without step times, the wall time of its call)
    timed: bool = True  # False: a GPU step that sampled nothing, whose time is unknown


class StepTrace:
    """Records the steps of `core` while it is active (a context manager)."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.steps: list[StepShape] = []
        self.wall_s = 0.0  # the `step()` calls' wall time, all of them
        self._pending: dict[int, tuple[int, int, int, int, int]] = {}  # scheduled, not collected
        self._collected: list[tuple[tuple[int, int, int, int, int], float | None]] = []
        self._scheduled: list[tuple[int, int, int, int, int]] = []
        self._times: list[float] = []

    def __enter__(self) -> StepTrace:
        self._pending, self._collected, self._scheduled, self._times = {}, [], [], []
        scheduler = self.core.scheduler
        schedule = self._schedule = scheduler.schedule
        update = self._update = scheduler.update

        def recording_schedule():
            scheduled = schedule()
            shape = _shape(scheduled)
            # Kept until collected, so `id` names this step alone while it is in flight.
            self._pending[id(scheduled)] = shape
            self._scheduled.append(shape)
            return scheduled

        def recording_update(scheduled, result):
            if (shape := self._pending.pop(id(scheduled), None)) is not None:
                self._collected.append((shape, result.device_s))
            return update(scheduled, result)

        scheduler.schedule = recording_schedule
        scheduler.update = recording_update
        return self

    def step(self) -> list:
        """One engine step, timed; its outputs."""
        start = time.perf_counter()
        outputs = self.core.step()
        self._times.append(time.perf_counter() - start)
        return outputs

    def __exit__(self, *exc) -> None:
        scheduler = self.core.scheduler
        scheduler.schedule, scheduler.update = self._schedule, self._update
        self.wall_s = sum(self._times)
        if any(d is not None for _, d in self._collected):
            # A GPU step that samples nothing has no end event: it counts 0 here, its device
            # time falls in `host_bound_s`, and its kind says so.
            collected = self._collected
            self.steps = [StepShape(*shape, d or 0.0, d is not None) for shape, d in collected]
            return
        # No step times: each call's wall time for the step it scheduled (a call that
        # schedules nothing, all waiting on the one before, still takes time).
        shapes = self._scheduled + [(0, 0, 0, 0, 0)] * (len(self._times) - len(self._scheduled))
        self.steps = [StepShape(*s, t) for s, t in zip(shapes, self._times, strict=False)]


def _shape(scheduled) -> tuple[int, int, int, int, int]:
    """(prompt tokens, decode rows, sampled rows, KV tokens read, prompt attention tokens)."""
    prompt = decode = sampled = kv = attention = 0
    for c in scheduled.chunks:
        end = c.start_pos + c.num_tokens
        kv += end if not c.is_decode else c.num_tokens * (c.start_pos + 1)
        sampled += c.samples
        if c.is_decode:
            decode += 1
        else:
            prompt += c.num_tokens
            attention += c.num_tokens * (c.start_pos + end + 1) // 2
    return prompt, decode, sampled, kv, attention


@dataclass(frozen=True)
class Device:
    read_bytes_per_s: float
    matmul_flops_per_s: float


def matmul_flops() -> float:
    """bf16 FLOP/s of a large product (8192 x 4096 by 4096 x 14336: the 8B shape's MLP at a
    full prefill chunk)."""
    a = torch.randn(8192, 4096, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(4096, 14336, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        a @ b
    torch.cuda.synchronize()
    return 2 * 8192 * 4096 * 14336 * 20 / (time.perf_counter() - start)


@dataclass(frozen=True)
class ModelCosts:
    weight_bytes: int  # read once a step (the embedding table excluded: a row per token)
    layer_params: int  # parameters every token multiplies by
    head_params: int  # the output head's, for sampled rows only
    kv_bytes_per_token: int  # keys and values of one token, every layer
    attention_width: int  # query heads x head_dim x layers

    @classmethod
    def of(cls, core: EngineCore) -> ModelCosts:
        """A dense decoder's costs from its config (the weights in the model's dtype)."""
        cfg = core.config.model
        q = cfg.num_heads * cfg.head_dim
        layer = cfg.hidden_size * (2 * q + 2 * cfg.kv_size + 3 * cfg.intermediate_size)
        head = cfg.vocab_size * cfg.hidden_size
        layer_params = cfg.num_layers * layer
        return cls(
            weight_bytes=(layer_params + head) * core.config.dtype.itemsize,
            layer_params=layer_params,
            head_params=head,
            kv_bytes_per_token=2 * cfg.num_layers * cfg.kv_size * core.config.cache.dtype.itemsize,
            attention_width=q * cfg.num_layers,
        )

    def floor_s(self, s: StepShape, device: Device) -> float:
        if s.prompt_tokens + s.decode_rows == 0:
            return 0.0
        flops = (
            2 * self.layer_params * (s.prompt_tokens + s.decode_rows)
            + 2 * self.head_params * s.sampled_rows
            + 4 * self.attention_width * s.prompt_attention_tokens
        )
        weights = self.weight_bytes / device.read_bytes_per_s
        kv = s.kv_read_tokens * self.kv_bytes_per_token / device.read_bytes_per_s
        return max(weights, flops / device.matmul_flops_per_s) + kv


def kind_of(s: StepShape) -> str:
    if not s.timed:
        return "untimed (samples nothing)"
    if s.prompt_tokens:
        return "with prompt tokens"
    if not s.decode_rows:
        return "empty"
    for bound in (16, 64, 256):
        if s.decode_rows <= bound:
            return f"decode, <= {bound} rows"
    return "decode, > 256 rows"


def kind_of_scheduled(scheduled) -> str:
    """The kind (`kind_of`) of a step as the scheduler laid it out, before it runs."""
    return kind_of(StepShape(*_shape(scheduled), seconds=0.0))


def report(steps: list[StepShape], costs: ModelCosts, device: Device, wall_s: float) -> dict:
    """The run's floor and its fraction of the run's `wall_s`, in total and by kind of step."""
    kinds: dict[str, dict[str, float]] = {}
    for s in steps:
        k = kinds.setdefault(kind_of(s), {"steps": 0, "seconds": 0.0, "floor_s": 0.0})
        k["steps"] += 1
        k["seconds"] += s.seconds
        k["floor_s"] += costs.floor_s(s, device)
    stepped = sum(k["seconds"] for k in kinds.values())
    floor = sum(k["floor_s"] for k in kinds.values())
    for k in kinds.values():
        k["lost_s"] = k["seconds"] - k["floor_s"]
    return {
        "steps": len(steps),
        "wall_s": wall_s,
        "step_s": stepped,  # the steps' own time (on the device, where the engine keeps it)
        "host_bound_s": wall_s - stepped,  # the device waiting on the host, between steps
        "floor_s": floor,
        "fraction_of_floor": floor / wall_s if wall_s else 0.0,
        "kv_read_bytes": sum(s.kv_read_tokens for s in steps) * costs.kv_bytes_per_token,
        "by_kind": kinds,
    }


def describe(r: dict) -> str:
    lines = [
        f"floor {r['floor_s']:.1f} s of {r['wall_s']:.1f} s in {r['steps']} steps "
        f"({100 * r['fraction_of_floor']:.1f}% of the floor reached); the steps "
        f"{r['step_s']:.1f} s, between them {r['host_bound_s']:.2f} s"
    ]
    for name, k in sorted(r["by_kind"].items(), key=lambda kv: -kv[1]["lost_s"]):
        lines.append(
            f"  {name:22s} {int(k['steps']):6d} steps  time {k['seconds']:7.2f} s  floor "
            f"{k['floor_s']:7.2f} s  lost {k['lost_s']:6.2f} s"
        )
    return "\n".join(lines)
