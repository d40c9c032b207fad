"""Draw the `met serve --tui` dashboard on a scripted run and save it as an SVG.

    python scripts/tui_screenshot.py [OUT]     (default: docs/tui.svg)

The events are made up but shaped like a server's: the ten startup phases, a few requests in
flight and finished, step summaries and log lines, all at fixed times with a fixed clock, so the
picture shows the same numbers on every run. It runs headless: no terminal needed.
"""

from __future__ import annotations

import argparse
import asyncio
import math
from pathlib import Path

from metrale.telemetry import events
from metrale.telemetry.bus import EventBus
from metrale.tui.dashboard import Dashboard

SIZE = (120, 40)
START_S = 1_767_225_600.0  # the scripted server starts here (Unix seconds)
PHASES = (  # as `met serve` names them
    ("resolve model", 0.04),
    ("load config", 0.01),
    ("select kernels", 0.32),
    ("backend", 1.85),
    ("communication backend", 0.02),
    ("preflight and weights", 7.41),
    ("tokenizer and template", 0.28),
    ("scheduler", 2.06),
    ("router", 0.11),
    ("listening", 0.05),
)


def scripted_events() -> tuple[list[events.Event], float]:
    """The events of a short scripted run, and the clock time the picture is taken at."""
    out: list[events.Event] = []
    now_s = START_S
    for index, (name, duration_s) in enumerate(PHASES, start=1):
        out.append(events.Phase(time=now_s, index=index, total=len(PHASES), name=name))
        now_s += duration_s
        out.append(
            events.Phase(
                time=now_s, index=index, total=len(PHASES), name=name, duration_s=duration_s
            )
        )
    out.append(events.Log(time=now_s, level="info", logger="metrale.serve", message="listening"))
    apis = ("chat", "completions", "messages", "chat", "chat", "messages")
    for number in range(12):  # finished requests, for the latency panel
        request_id = f"req-{number:04d}"
        api = apis[number % len(apis)]
        out.append(_admitted(now_s + number, request_id, api, 200 + 37 * number))
        out.append(
            events.RequestFinished(
                time=now_s + number + 2.0,
                request_id=request_id,
                api=api,
                finish_reason="stop" if number % 5 else "length",
                prompt_tokens=200 + 37 * number,
                cached_tokens=64 * (number % 3),
                generated_tokens=40 + 9 * number,
                queue_s=0.002 * number,
                ttft_s=0.045 + 0.011 * number,
                decode_s=(40 + 9 * number - 1) * (0.011 + 0.0004 * number),
                e2e_s=2.0,
            )
        )
    now_s += 20.0
    live = [(f"req-{number:04d}", apis[number % len(apis)]) for number in range(12, 18)]
    for offset, (request_id, api) in enumerate(live):
        out.append(_admitted(now_s + 0.4 * offset, request_id, api, 512 + 128 * offset))
    for offset, (request_id, _) in enumerate(live[:4]):
        out.append(
            events.RequestFirstToken(
                time=now_s + 0.4 * offset + 0.08,
                request_id=request_id,
                cached_tokens=256 * (offset % 2),
                ttft_s=0.08,
            )
        )
    for step in range(60):  # one summary a tenth of a second: a burst that levels off
        generated = [(request_id, step + 3 * offset) for offset, (request_id, _) in enumerate(live)]
        out.append(
            events.StepSummary(
                time=now_s + 0.1 * step,
                running=4,
                waiting=2,
                kv_cache_usage=min(0.62, 0.01 * step + 0.05),
                prefix_cache_hit_rate=0.41,
                prompt_tokens_per_s=3000.0 * math.exp(-step / 8.0),
                generation_tokens_per_s=380.0 + 60.0 * math.sin(step / 5.0),
                steps=9,
                live=[events.LiveRequest(rid, count) for rid, count in generated[:4]],
            )
        )
    now_s += 6.0
    out.append(events.Preemption(time=now_s, request_id="req-0013"))
    out.append(
        events.Log(
            time=now_s,
            level="warning",
            logger="metrale.engine",
            message="KV cache above 60%: long prompts may wait",
        )
    )
    out.append(events.Dropped(time=now_s, count=3))
    return out, now_s + 1.0


def _admitted(time_s: float, request_id: str, api: str, prompt_tokens: int) -> events.Event:
    return events.RequestAdmitted(
        time=time_s, request_id=request_id, api=api, prompt_tokens=prompt_tokens, max_tokens=512
    )


async def take_screenshot(path: Path) -> Path:
    """Run the dashboard headless on the scripted events and save its screen to `path`."""
    bus = EventBus()
    bus.bind_loop()
    subscription = bus.subscribe(capacity=10_000)
    scripted, now_s = scripted_events()
    app = Dashboard(subscription, "metrale  Qwen3-0.6B", clock=lambda: now_s)
    async with app.run_test(size=SIZE) as pilot:
        for event in scripted:
            bus.publish(event)
        await pilot.pause()
        app.refresh_view()
        await pilot.pause()
        path.parent.mkdir(parents=True, exist_ok=True)
        app.save_screenshot(filename=path.name, path=str(path.parent))
    subscription.close()
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", type=Path, default=Path("docs/tui.svg"))
    args = parser.parse_args()
    print(asyncio.run(take_screenshot(args.out)))


if __name__ == "__main__":
    main()
