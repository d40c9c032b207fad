"""What one benchmark run measured, with `vllm bench serve`'s definitions and names.

Per request (`RequestResult`), as the client saw it:

- TTFT: from sending the request to the first chunk that carries output (text, reasoning or
  tool-call arguments);
- ITL: the gaps between consecutive output chunks (one entry per gap);
- E2EL: from sending to the last output chunk;
- TPOT: (E2EL - TTFT) / (output tokens - 1), for a request of more than one output token.

A run's summary (`summarize`) follows vLLM's `calculate_metrics`: only successful requests count;
the throughputs divide by the run's wall time; TPOT is averaged over requests, ITL over gaps;
each latency has a mean, median, standard deviation (population) and percentiles (linear
interpolation, numpy's default), in milliseconds. Goodput counts the successful requests whose
TTFT, TPOT and E2EL are all within the SLOs given (`--goodput ttft:MS tpot:MS e2el:MS`); a
one-token request's TPOT is 0 for that test.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

LATENCIES = ("ttft", "tpot", "itl", "e2el")
SLO_METRICS = ("ttft", "tpot", "e2el")
DEFAULT_PERCENTILES = (90.0, 99.0)


@dataclass
class RequestResult:
    """One request as the client saw it; times in seconds."""

    prompt_len: int  # the dataset's count of the prompt's tokens
    success: bool = False
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0  # E2EL
    output_tokens: int | None = None  # the server's usage count; None when it reported none
    generated_text: str = ""
    error: str = ""
    start_time: float = 0.0  # perf_counter at send

    @property
    def output_chunks(self) -> int:
        return len(self.itl) + 1 if self.success else 0


def parse_goodput(specs: Sequence[str]) -> dict[str, float]:
    """`["ttft:200", "tpot:50"]` as {"ttft": 200.0, "tpot": 50.0} (milliseconds); a ValueError
    names what is wrong."""
    slos: dict[str, float] = {}
    for spec in specs:
        name, sep, value = spec.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(
                f"--goodput {spec!r}: give NAME:MILLISECONDS with NAME one of "
                f"{', '.join(SLO_METRICS)}, e.g. --goodput ttft:200 tpot:50"
            )
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {spec!r}: {value!r} is not a number of ms") from None
        if not math.isfinite(slos[name]) or slos[name] < 0:
            raise ValueError(f"--goodput {spec!r}: the SLO must be a finite number >= 0")
    return slos


def output_len(result: RequestResult, count_tokens: Callable[[str], int] | None) -> int:
    """A successful request's output tokens: the server's usage, else the text tokenized, else
    (no tokenizer) one per output chunk."""
    if result.output_tokens:
        return result.output_tokens
    if count_tokens is not None:
        return count_tokens(result.generated_text)
    return result.output_chunks


def summarize(
    results: Sequence[RequestResult],
    duration_s: float,
    *,
    goodput: dict[str, float] | None = None,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
    count_tokens: Callable[[str], int] | None = None,
) -> dict[str, float | int]:
    """The run's metrics under vLLM's names (`mean_ttft_ms`, `p99_itl_ms`, ...)."""
    done = [r for r in results if r.success]
    out_lens = [output_len(r, count_tokens) for r in done]
    tpots = [(r.latency - r.ttft) / (n - 1) for r, n in zip(done, out_lens, strict=True) if n > 1]
    samples = {
        "ttft": [r.ttft for r in done],
        "tpot": tpots,
        "itl": [gap for r in done for gap in r.itl],
        "e2el": [r.latency for r in done],
    }
    total_input = sum(r.prompt_len for r in done)
    total_output = sum(out_lens)
    seconds = max(duration_s, 1e-9)
    summary: dict[str, float | int] = {
        "duration": duration_s,
        "completed": len(done),
        "failed": len(results) - len(done),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(done) / seconds,
        "output_throughput": total_output / seconds,
        "total_token_throughput": (total_input + total_output) / seconds,
    }
    # The ITL per token, as a server counts it (tokens that arrive in one chunk are 0 s apart):
    # the time after each first token over the tokens after it. vLLM's ITL above is per chunk,
    # longer when a chunk carries several tokens.
    gaps = [(r.latency - r.ttft, n - 1) for r, n in zip(done, out_lens, strict=True) if n > 1]
    summary["mean_itl_per_token_ms"] = (
        1e3 * sum(g for g, _ in gaps) / sum(k for _, k in gaps) if gaps else 0.0
    )
    if goodput:
        good = sum(_meets(r, n, goodput) for r, n in zip(done, out_lens, strict=True))
        summary["request_goodput"] = good / seconds
    for name in LATENCIES:
        values_ms = np.asarray(samples[name], dtype=np.float64) * 1e3
        empty = values_ms.size == 0
        summary[f"mean_{name}_ms"] = 0.0 if empty else float(values_ms.mean())
        summary[f"median_{name}_ms"] = 0.0 if empty else float(np.median(values_ms))
        summary[f"std_{name}_ms"] = 0.0 if empty else float(values_ms.std())
        for p in percentiles:
            value = 0.0 if empty else float(np.percentile(values_ms, p))
            summary[f"p{percentile_label(p)}_{name}_ms"] = value
    return summary


def percentile_label(p: float) -> str:
    """99.0 -> "99", 99.9 -> "99.9" (vLLM's key spelling)."""
    return str(int(p)) if float(p).is_integer() else str(p)


def _meets(result: RequestResult, out_len: int, slos: dict[str, float]) -> bool:
    tpot = (result.latency - result.ttft) / (out_len - 1) if out_len > 1 else 0.0
    values_ms = {"ttft": result.ttft * 1e3, "tpot": tpot * 1e3, "e2el": result.latency * 1e3}
    return all(values_ms[name] <= slo for name, slo in slos.items())
