"""What the telemetry adds to the API process's work per generated token, measured in one
process where nothing else competes: the quiet figure that `bench/serve_telemetry.py` cannot
give on a shared host (its rounds swing ±20% with the host's load while the API process, the
bottleneck at hundreds of streams, stays 95-99% busy).

Each round runs the API process's per-batch work for `--streams` requests of `--output-len`
tokens, one token per request per engine step, as `AsyncLLM` runs it: `OutputProcessor`
(detokenizing with the demo tokenizer), each delta counted into its HTTP request's access
record, then the telemetry. Two variants take turns batch by batch:

- `telemetry`: `Telemetry` with the Prometheus series and one `/v1/events` subscriber whose
  events are framed as the route frames them;
- `disabled`: what `met serve --disable-log-stats` runs with no subscriber (`Telemetry` without
  series: it still tracks live requests, for a reader that may connect).

The difference, in microseconds per token, over the API process's whole CPU time per token in
the server (`--server-result`: a `serve_telemetry` JSON; the `disabled` server's median) is the
share of throughput the telemetry can cost where the API process is the bottleneck.

    python bench/telemetry_cost.py [--streams 256 --output-len 256 --rounds 20] \\
        [--server-result bench/results/serve_telemetry-h200-...json]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import statistics
import time
from pathlib import Path

from provenance import git_sha, metrale_tree

from metrale.engine.messages import (
    EngineOutput,
    EngineRequest,
    FinishReason,
    KVCacheStats,
    Outputs,
    RequestTiming,
    StepStats,
)
from metrale.frontend.output_processor import OutputProcessor
from metrale.sampling_params import SamplingParams
from metrale.server.access_log import RequestRecord
from metrale.telemetry import events
from metrale.telemetry.bus import EventBus
from metrale.telemetry.hub import Telemetry
from metrale.telemetry.metrics import Metrics
from metrale.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent
DEMO_TOKENIZER = ROOT.parent / "metrale" / "demo" / "tokenizer"
VARIANTS = ("telemetry", "disabled")


def kv_state(running: int) -> KVCacheStats:
    return KVCacheStats(
        num_blocks=8192,
        num_used_blocks=running * 24,
        num_cached_blocks=0,
        block_size=16,
        bytes_per_block=1,
        num_prefix_queried_tokens=0,
        num_prefix_hit_tokens=0,
        num_running=running,
        num_waiting=0,
        num_preemptions=0,
    )


class Pipeline:
    """The API process's per-batch work for one variant, with state of its own."""

    def __init__(self, tokenizer: Tokenizer, ids: list[str], telemetry_on: bool) -> None:
        bus = EventBus()
        self.telemetry = Telemetry(Metrics("bench", 4096) if telemetry_on else None, bus)
        self.subscription = bus.subscribe() if telemetry_on else None
        self.processor = OutputProcessor(tokenizer)
        self.records = {i: RequestRecord("POST", "/v1/completions", 0.0) for i in ids}
        self.ids = ids

    def admit(self, output_len: int) -> None:
        params = SamplingParams(max_tokens=output_len, ignore_eos=True)
        arrival = time.monotonic()
        for request_id in self.ids:
            self.processor.add_request(request_id, 128, params)
            request = EngineRequest(request_id, [1] * 128, params, arrival)
            self.telemetry.request_added(request, "completions")

    def batch(self, batch: Outputs) -> None:
        now = time.monotonic()
        deltas, timings = [], {}
        for output in batch.outputs:
            delta = self.processor.process(output)
            if delta is None:
                continue
            if output.timing is not None:
                timings[delta.request_id] = output.timing
            deltas.append(delta)
            self.records[delta.request_id].add(delta)
        self.telemetry.deltas(deltas, timings, now)
        self.telemetry.engine_outputs(batch, now)
        if self.subscription is not None:  # the /v1/events route's framing of what it got
            while (event := self.subscription.get_nowait()) is not None:
                b"event: %s\ndata: %s\n\n" % (events.type_of(event).encode(), events.encode(event))

    def close(self) -> None:
        for request_id in self.ids:
            self.telemetry.request_closed(request_id)  # AsyncLLM.generate's cleanup: a no-op
        assert not self.telemetry.live and not self.processor._states


def one_round(tokenizer: Tokenizer, streams: int, output_len: int) -> dict[str, float]:
    """Seconds of each variant's API-side work for one round of `streams` x `output_len`
    tokens. The variants take turns batch by batch (in alternating order), so the machine's
    drift, which swamps a whole-round comparison here, falls on both alike."""
    ids = [f"cmpl-{i}-0" for i in range(streams)]
    batches = [
        Outputs(
            [
                EngineOutput(
                    request_id,
                    [10 + (step * 7 + n) % 4000],
                    [],
                    FinishReason.LENGTH if step == output_len - 1 else None,
                    0,
                    RequestTiming(0.0, 0.001, 0.002) if step == 0 else None,
                )
                for n, request_id in enumerate(ids)
            ],
            kv_state(streams),
            [],
            [StepStats(streams, streams, 1e-4, 4e-3, True, [])],
        )
        for step in range(output_len)
    ]
    pipelines = {name: Pipeline(tokenizer, ids, name == "telemetry") for name in VARIANTS}
    seconds = dict.fromkeys(VARIANTS, 0.0)
    gc.collect()  # the round's inputs are built; a collection inside the timing is noise
    gc.disable()
    try:
        for step, batch in enumerate(batches):
            for name in VARIANTS if step % 2 == 0 else VARIANTS[::-1]:
                pipeline = pipelines[name]
                start = time.perf_counter()
                if step == 0:
                    pipeline.admit(output_len)
                pipeline.batch(batch)
                if step == output_len - 1:
                    pipeline.close()
                seconds[name] += time.perf_counter() - start
    finally:
        gc.enable()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=20, help="rounds of each variant")
    parser.add_argument("--server-result", type=Path, help="a serve_telemetry JSON")
    parser.add_argument("--out", type=Path, default=ROOT / "results")
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    tokenizer = Tokenizer.from_dir(DEMO_TOKENIZER)
    tokens = args.streams * args.output_len
    one_round(tokenizer, args.streams, 8)  # warm up
    per_token: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(args.rounds):
        for name, seconds in one_round(tokenizer, args.streams, args.output_len).items():
            per_token[name].append(1e6 * seconds / tokens)
    medians = {name: statistics.median(v) for name, v in per_token.items()}
    # Each round's two figures share its drift: the median of the differences.
    added = statistics.median(
        t - d for t, d in zip(per_token["telemetry"], per_token["disabled"], strict=True)
    )
    result = {
        "benchmark": "telemetry_cost",
        "date": datetime.date.today().isoformat(),
        "git_sha": git_sha(),
        "metrale_tree": metrale_tree(),
        "machine": {"cpu": platform.processor() or platform.machine()},
        "workload": {"streams": args.streams, "output_len": args.output_len, "rounds": args.rounds},
        "us_per_token_note": "each variant's API-side work per token, rounds in order",
        "us_per_token": per_token,
        "median_us_per_token": medians,
        "telemetry_adds_us_per_token": added,
    }
    if args.server_result:
        server = json.loads(args.server_result.read_text())
        api_us = server["median_cpu_ms_per_1k_tokens"]["baseline"]["api"]  # ms/1k = us/token
        result["server"] = {
            "result": str(args.server_result),
            "api_us_per_token": api_us,
            "api_busy_median": statistics.median(
                r["api_busy"] for r in server["runs"]["baseline"] if r["api_busy"] is not None
            ),
        }
        result["telemetry_share_of_api_time"] = added / api_us
    args.out.mkdir(parents=True, exist_ok=True)
    label = f"-{args.label}" if args.label else ""
    path = args.out / f"telemetry_cost{label}-{result['date']}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    summary = {k: v for k, v in result.items() if k not in ("us_per_token",)}
    print(json.dumps(summary, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
