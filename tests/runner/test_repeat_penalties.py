"""The penalties (counted, DRY, LZ), batched on the device from the history kept there, against
the plain references of `reference_repeats.py`, step by step as the runner drives them: the
slot filled from the prompt, then each sampled token appended on the device, with the host one
token behind (async scheduling) or not."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from metrale.engine.step import ScheduledChunk, TokenHistory
from metrale.runner.repeat_history import RepeatHistory, SequenceBreakers, TokenView, suffix_matches
from metrale.runner.repeat_penalties import apply_repeat_penalties
from metrale.sampling_params import DryBreakers, SamplingParams
from tests.runner.reference_repeats import ref_penalised

VOCAB = 12
# 3 breaks alone, and 3 7 is a longer breaker from the same head; 4 heads two
BREAKERS = DryBreakers(single=(3,), sequences=((3, 7), (4, 1, 1), (4, 5), (5, 1, 2), (6, 6, 7)))


def brute_suffix_matches(tokens: list[int]) -> list[int]:
    n = len(tokens)
    out = []
    for p in range(n):
        length = 0
        while p < n - 1 and length <= p and tokens[p - length] == tokens[n - 1 - length]:
            length += 1
        out.append(length)
    return out


@given(st.lists(st.integers(0, 3), min_size=1, max_size=60))
def test_suffix_matches_are_the_reversed_z_function(tokens):
    assert suffix_matches(tokens).tolist() == brute_suffix_matches(tokens)


class Request:
    """A request's tokens as the host knows them and as the device has them."""

    def __init__(self, request_id: str, prompt: list[int], script: list[int], params):
        self.request_id, self.params = request_id, params
        self.history = TokenHistory(list(prompt), [])
        self.script = list(script)  # the tokens it will "sample"
        self.pending: list[int] = []  # sampled, not yet seen by the host

    @property
    def context(self) -> list[int]:
        return self.history.prompt_token_ids + self.history.output_token_ids + self.pending

    def chunk(self) -> ScheduledChunk:
        return ScheduledChunk(
            self.request_id, [0], 0, [], True, self.params, token_history=self.history
        )


def reference(logits: torch.Tensor, request: Request) -> torch.Tensor:
    prompt_len = len(request.history.prompt_token_ids)
    row = ref_penalised(logits.double().tolist(), request.context, prompt_len, request.params)
    return torch.tensor(row, dtype=torch.float32)


def run_steps(
    requests: list[Request],
    async_scheduling: bool,
    seed: int = 0,
    vocab: int = VOCAB,
    device: str = "cpu",
    max_live: int = 64,
) -> int:
    """Step the requests (at most `max_live` at once) to the end of their scripts, checking
    every step's logits against the references; returns the number of rows checked. A batch
    row that uses neither penalty sits between them and must come back bit-identical."""
    history = RepeatHistory(max_seq_len=1024, vocab_size=vocab, device=torch.device(device))
    generator = torch.Generator().manual_seed(seed)
    checked = 0
    waiting = list(requests)
    live = [waiting.pop(0) for _ in range(min(max_live, len(waiting)))]
    while live:
        rows = [(2 * i + 1, r.chunk()) for i, r in enumerate(live)]  # even rows use neither
        repeats = history.prepare(rows)
        logits = torch.randn(2 * len(live) + 1, vocab, generator=generator) * 3
        adjusted = logits.to(device, copy=True)
        apply_repeat_penalties(adjusted, repeats)
        adjusted = adjusted.cpu()
        for i, request in enumerate(live):
            expected = reference(logits[2 * i + 1], request)
            torch.testing.assert_close(adjusted[2 * i + 1], expected, rtol=1e-5, atol=1e-4)
            checked += 1
        for row in range(0, 2 * len(live) + 1, 2):
            assert torch.equal(adjusted[row], logits[row])
        sampled = torch.zeros(2 * len(live) + 1, dtype=torch.int64)
        for i, request in enumerate(live):
            sampled[2 * i + 1] = request.script.pop(0)
        history.append(repeats, sampled.to(device))
        for i, request in enumerate(live):
            # the host learns the token the step after (async) or at once
            request.history.output_token_ids.extend(request.pending)
            request.pending = [int(sampled[2 * i + 1])]
            if not async_scheduling:
                request.history.output_token_ids.extend(request.pending)
                request.pending = []
        for request in [r for r in live if not r.script]:
            history.free(request.request_id)
            live.remove(request)
            if waiting:  # into a freed slot, over what its last request left there
                live.append(waiting.pop(0))
    assert not history.slots and sorted(history._free) == list(range(history.num_slots))
    return checked


def dry(**kw) -> SamplingParams:
    kw.setdefault("dry_multiplier", 0.8)
    return SamplingParams(dry_breakers=kw.pop("dry_breakers", BREAKERS), **kw)


tokens = st.lists(st.integers(0, 7), min_size=1, max_size=40)


@settings(max_examples=150, deadline=None)
@given(
    prompts=st.lists(tokens, min_size=3, max_size=3),
    scripts=st.lists(st.lists(st.integers(0, 7), min_size=1, max_size=25), min_size=3, max_size=3),
    base=st.sampled_from([1.0, 1.75, 3.0]),
    allowed=st.integers(0, 3),
    last_n=st.sampled_from([-1, 0, 1, 6, 15]),
    lz=st.sampled_from([0.0, 0.15, 1.0]),
    counted=st.sampled_from(
        [{}, {"presence_penalty": 0.7, "repetition_penalty": 1.3}, {"frequency_penalty": -0.5}]
    ),
    window=st.sampled_from([0, 1, 7]),
    async_scheduling=st.booleans(),
)
def test_a_batch_matches_the_references_step_by_step(
    prompts, scripts, base, allowed, last_n, lz, counted, window, async_scheduling
):
    params = [
        dry(dry_base=base, dry_allowed_length=allowed, dry_penalty_last_n=last_n, **counted),
        SamplingParams(lz_penalty=lz, repetition_penalty=1.5, repetition_penalty_window=window),
        dry(dry_base=base, dry_allowed_length=allowed, lz_penalty=lz, dry_breakers=None),
    ]
    requests = [
        Request(f"r{i}", prompt, script, p)
        for i, (prompt, script, p) in enumerate(zip(prompts, scripts, params, strict=True))
    ]
    assert run_steps(requests, async_scheduling) == sum(len(s) for s in scripts)


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_long_contexts_use_the_windows(async_scheduling, device):
    """Past 512 tokens the LZ window slides; a DRY window of 100 cuts repeats that reach back
    further; a loop in a small alphabet makes long repeats and clamps DRY's exponent."""
    rng = random.Random(3)
    loop = [1, 2, 0, 7]  # no breaker in it
    prompt = [rng.randrange(8) for _ in range(100)] + loop * 150
    requests = [
        Request("lz", prompt, loop * 6 + [5], SamplingParams(lz_penalty=0.3)),
        Request("dry", prompt, loop * 6, dry(dry_penalty_last_n=100, dry_base=30.0)),
        Request("all", prompt[:-7], [rng.randrange(8) for _ in range(40)], dry(lz_penalty=0.2)),
    ]
    assert run_steps(requests, async_scheduling, device=device) == 25 + 24 + 40


def test_a_repeat_reaching_before_a_window_counts_only_inside_it():
    """DRY over the last 9 tokens: "1 2 0" ends the context and began it, followed by 7, but the
    window cuts that repeat to one token; the LZ window (512) cuts a match the same way."""
    dry_context = [1, 2, 0, 7, 8, 9, 10, 11, 1, 2, 0]
    filler = [t for t in range(520) if not 500 <= t <= 503][:508]  # tokens seen once
    lz_context = [590, 591, 500, 501, 502, 503, *filler, 500, 501, 502]
    requests = [
        Request("dry", dry_context, [4], dry(dry_penalty_last_n=9, dry_breakers=None)),
        Request("lz", lz_context, [4], SamplingParams(lz_penalty=1.0)),
    ]
    assert run_steps(requests, async_scheduling=False, vocab=600) == 2


@pytest.mark.parametrize(
    ("context", "last_n"),
    [
        # 3 breaks alone, 3 7 is longer: the repeat of "1 2" may not take in the 7
        ([7, 1, 2, 0, 3, 7, 1, 2], -1),
        # the breaker 4 1 1 starts before the window of 6: it does not cut the run of 1s
        ([4, 1, 1, 1, 1, 1, 1], 6),
    ],
)
def test_breakers_at_the_edges(context, last_n):
    request = Request("r", context, [0], dry(dry_allowed_length=1, dry_penalty_last_n=last_n))
    assert run_steps([request], async_scheduling=False) == 1


def test_slots_are_reused_and_grow():
    """More requests than the first slots, freed and refilled: nothing of an earlier request
    leaks into a later one."""
    rng = random.Random(5)
    requests = [
        Request(
            f"r{i}",
            [rng.randrange(6) for _ in range(rng.randrange(1, 50))],
            [rng.randrange(6) for _ in range(rng.randrange(1, 12))],
            dry(lz_penalty=0.1 * (i % 3)),
        )
        for i in range(20)
    ]
    assert run_steps(requests, async_scheduling=True, max_live=5) > 20


def test_the_sequence_breakers_scan_only_new_tokens():
    tracker = SequenceBreakers(BREAKERS.sequences)
    history = TokenHistory([0, 4, 5, 0, 0], [])
    tracker.scan(TokenView(history), 5)
    assert tracker.latest == (1, 1)  # the sequence (4, 5) from position 1
    history.output_token_ids.extend([5, 1])
    # taken next, 2 would end 5 1 2 (from position 5, tail 2)
    assert tracker.pending_breaks(TokenView(history), 7) == [(2, 2)]
    history.output_token_ids.append(2)
    tracker.scan(TokenView(history), 8)
    assert tracker.latest == (5, 2) and tracker.num_scanned == 8


def test_a_repeat_loses_and_a_new_token_does_not():
    """The plain case, by hand: 'a b c d a b c' followed by d would repeat four tokens."""
    history = RepeatHistory(max_seq_len=64, vocab_size=VOCAB, device=torch.device("cpu"))
    request = Request("r", [8, 1, 2, 9, 8, 1, 2], [0], dry(dry_breakers=None))
    repeats = history.prepare([(0, request.chunk())])
    logits = torch.zeros(1, VOCAB)
    apply_repeat_penalties(logits, repeats)
    penalties = -logits[0]
    # 9 would extend the repeat of "8 1 2" (3 tokens, 1 past the 2 allowed); no other token
    # follows an earlier match of the end.
    assert penalties[9].item() == pytest.approx(0.8 * 1.75)
    assert np.count_nonzero(penalties.numpy()) == 1
