"""DRY and the LZ penalty written one row at a time, as plain references: DRY transliterated from
llama.cpp's loops (`llama_sampler_dry_apply`: the breaker scan, the reversed Z-algorithm, the
per-token maximum, the clamped power), the LZ penalty from its definition by enumerating every
match (`metrale/runner/repeat_penalties.py`)."""

from __future__ import annotations

import math

from metrale.sampling_params import DryBreakers, SamplingParams


def ref_dry(
    logits: list[float],
    context: list[int],
    multiplier: float,
    base: float,
    allowed_length: int,
    last_n: int,
    breakers: DryBreakers | None,
) -> list[float]:
    out = list(logits)
    n = len(context)
    if multiplier == 0 or base < 1 or last_n == 0:
        return out
    last_n_repeat = n if last_n == -1 else min(n, last_n)
    if last_n_repeat <= allowed_length:
        return out
    restart: dict[int, list[tuple[int, ...]]] = {}
    if breakers is not None:
        for token in breakers.single:
            restart.setdefault(token, []).append(())
        for head, *tail in breakers.sequences:
            restart.setdefault(head, []).append(tuple(tail))

    def rat(i: int) -> int:
        return context[n - 1 - i]

    rep_limit = last_n_repeat
    for i in range(last_n_repeat):
        tails = restart.get(rat(i))
        if not tails:
            continue
        longest = -1
        for tail in tails:
            seq_len = len(tail)
            if (
                seq_len > longest
                and seq_len <= i
                and all(tail[o] == rat(i - o - 1) for o in range(seq_len))
            ):
                longest = seq_len
        if longest >= 0:
            rep_limit = i - longest
            break
    if rep_limit < allowed_length:
        return out

    counts = [0] * last_n_repeat
    last = last_n_repeat - 1
    rt = lt = 0
    for k in range(1, last_n_repeat):
        if k > rt:
            m = 0
            while m + k < last_n_repeat and rat(m) == rat(m + k):
                m += 1
            counts[last - k] = min(m, rep_limit)
            if m > 0:
                lt, rt = k, k + m - 1
        else:
            p = k - lt
            right_part_len = rt - k + 1
            if counts[last - p] < right_part_len:
                counts[last - k] = min(counts[last - p], rep_limit)
            else:
                i = rt + 1
                while i < last_n_repeat and rat(i) == rat(i - k):
                    i += 1
                counts[last - k] = min(i - k, rep_limit)
                lt, rt = k, i - 1

    max_repeat: dict[int, int] = {}
    for i in range(last_n_repeat - 1):
        repeat_len = counts[i]
        if repeat_len >= allowed_length:
            token = rat(last_n_repeat - 2 - i)
            max_repeat[token] = max(max_repeat.get(token, repeat_len), repeat_len)

    max_exponent = int(88.7228391 / math.log(base)) if base > 1.000001 else 0
    for token, repeat_len in max_repeat.items():
        if () in restart.get(token, []):
            continue
        exponent = repeat_len - allowed_length
        if max_exponent > 0 and exponent > max_exponent:
            exponent = max_exponent
        out[token] -= multiplier * base**exponent
    return out


def ref_lz(logits: list[float], context: list[int], strength: float) -> list[float]:
    out = list(logits)
    n = len(context)
    window_start = max(0, n - 512)
    cheapest: dict[int, float] = {}
    for q in range(window_start, n):  # a match ending at q, the candidate being context[q]
        distance = n - q
        for length in range(1, 33):
            if q - length + 1 < window_start:
                break
            if length > 1 and context[q - length + 1] != context[n - length + 1]:
                break
            cost = (math.log(distance) + math.log(length)) / length
            token = context[q]
            cheapest[token] = min(cheapest.get(token, math.inf), cost)
    literal = math.log(len(logits))
    for token, cost in cheapest.items():
        out[token] -= strength * max(0.0, literal - cost)
    return out


def ref_counted(
    logits: list[float],
    context: list[int],
    prompt_len: int,
    presence: float,
    frequency: float,
    repetition: float,
    window: int,
) -> list[float]:
    """vLLM's repetition, frequency and presence penalties over the last `window` tokens of
    prompt and output (0: all): repetition over both, the others over the output."""
    out = list(logits)
    start = max(len(context) - window, 0) if window else 0
    seen = context[start:]
    output = context[max(start, prompt_len) :]
    for token in set(seen):
        out[token] = out[token] / repetition if out[token] > 0 else out[token] * repetition
    for token in set(output):
        out[token] -= frequency * output.count(token) + presence
    return out


def ref_penalised(
    logits: list[float], context: list[int], prompt_len: int, params: SamplingParams
) -> list[float]:
    """Every penalty `params` asks for, in the engine's order: counted, DRY, LZ."""
    if params.has_penalties:
        logits = ref_counted(
            logits,
            context,
            prompt_len,
            params.presence_penalty,
            params.frequency_penalty,
            params.repetition_penalty,
            params.repetition_penalty_window,
        )
    if params.uses_dry:
        logits = ref_dry(
            logits,
            context,
            params.dry_multiplier,
            params.dry_base,
            params.dry_allowed_length,
            params.dry_penalty_last_n,
            params.dry_breakers,
        )
    if params.lz_penalty > 0:
        logits = ref_lz(logits, context, params.lz_penalty)
    return logits
