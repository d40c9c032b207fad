"""llama.cpp's truncation samplers (top-nσ, typical, XTC), batched, against references written
here one row at a time after llama.cpp's loops (`src/llama-sampling.cpp`), in float64."""

from __future__ import annotations

import math

import pytest
import torch

from metrale.runner.random_draws import NUM_DRAWS, seeded_draws
from metrale.runner.sampler import sample
from metrale.runner.truncation import Truncation, truncate
from metrale.sampling_params import SamplingParams
from tests.runner.test_sampler import make_meta, redraw, seeded

VOCAB = 64


def ref_top_n_sigma(logits: list[float], n: float) -> list[float]:
    finite = [x for x in logits if x != -math.inf]
    mean = sum(finite) / len(finite)
    std = math.sqrt(sum((x - mean) ** 2 for x in finite) / len(finite))
    cut = max(finite) - n * std
    return [-math.inf if x < cut else x for x in logits]


def softmax(logits: list[float]) -> list[float]:
    top = max(logits)
    exps = [math.exp(x - top) if x != -math.inf else 0.0 for x in logits]
    total = sum(exps)
    return [e / total for e in exps]


def ref_typical(logits: list[float], p: float) -> list[float]:
    q = softmax(logits)
    alive = [i for i, x in enumerate(logits) if x != -math.inf]
    entropy = -sum(q[i] * math.log(q[i]) for i in alive)
    ranked = sorted(alive, key=lambda i: abs(-math.log(q[i]) - entropy))
    kept, mass = set(), 0.0
    for i in ranked:
        kept.add(i)
        mass += q[i]
        if mass > p:
            break
    return [x if i in kept else -math.inf for i, x in enumerate(logits)]


def ref_xtc(logits: list[float], threshold: float) -> list[float]:
    """XTC when its draw falls under its probability."""
    if threshold > 0.5:
        return logits
    q = softmax(logits)
    ranked = sorted(range(len(q)), key=lambda i: q[i], reverse=True)
    above = [i for i in ranked if q[i] >= threshold]
    if len(above) < 2:
        return logits
    removed = set(above[:-1])
    return [-math.inf if i in removed else x for i, x in enumerate(logits)]


def truncation(rows, *, sigma=None, typical=None, thr=None, prob=None) -> Truncation:
    k = len(rows)
    sigma, typical = sigma or [-1.0] * k, typical or [1.0] * k
    thr, prob = thr or [0.1] * k, prob or [0.0] * k
    return Truncation(
        rows=torch.tensor(rows),
        top_n_sigma=torch.tensor(sigma),
        typical_p=torch.tensor(typical),
        xtc_threshold=torch.tensor(thr),
        xtc_probability=torch.tensor(prob),
        any_top_n_sigma=any(s > 0 for s in sigma),
        any_typical=any(t < 1 for t in typical),
        any_xtc=any(p > 0 for p in prob),
    )


def any_draws(logits: torch.Tensor) -> torch.Tensor:
    """Fresh uniform draws for each row of `logits` (`SamplingMetadata.draws`)."""
    return torch.rand(logits.shape[0], NUM_DRAWS, dtype=torch.float64)


def random_logits(num_rows: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    logits = torch.randn(num_rows, VOCAB, generator=seeded(seed), dtype=torch.float64) * scale
    logits[:, :3] = -math.inf  # an earlier filter's work: not candidates
    return logits.float()


def masks(logits: torch.Tensor) -> list[list[bool]]:
    return [[x == -math.inf for x in row] for row in logits.tolist()]


def test_top_n_sigma_matches_llama_cpp():
    sigmas = [0.5, 1.0, 2.0, 3.0, -1.0, 0.0]
    logits = random_logits(len(sigmas))
    out = truncate(logits, truncation(list(range(len(sigmas))), sigma=sigmas), any_draws(logits))
    for row, n in enumerate(sigmas):
        row_logits = logits[row].double().tolist()
        expected = ref_top_n_sigma(row_logits, n) if n > 0 else row_logits
        assert masks(out[row : row + 1]) == masks(torch.tensor([expected])), n


def test_top_n_sigma_ignores_the_temperature():
    logits = random_logits(1)
    t = truncation([0], sigma=[1.0])
    assert masks(truncate(logits, t, any_draws(logits))) == masks(
        truncate(logits / 0.3, t, any_draws(logits / 0.3))
    )


def test_typical_matches_llama_cpp():
    ps = [0.2, 0.5, 0.9, 0.95, 1.0]
    logits = random_logits(len(ps), seed=1)
    out = truncate(logits, truncation(list(range(len(ps))), typical=ps), any_draws(logits))
    for row, p in enumerate(ps):
        expected = ref_typical(logits[row].double().tolist(), p)
        assert masks(out[row : row + 1]) == masks(torch.tensor([expected])), p


def test_xtc_matches_llama_cpp_when_it_fires():
    thresholds = [0.02, 0.05, 0.1, 0.3, 0.6]
    logits = random_logits(len(thresholds), seed=2, scale=1.5)
    t = truncation(list(range(len(thresholds))), thr=thresholds, prob=[1.0] * len(thresholds))
    out = truncate(logits, t, any_draws(logits))
    for row, threshold in enumerate(thresholds):
        expected = ref_xtc(logits[row].double().tolist(), threshold)
        assert masks(out[row : row + 1]) == masks(torch.tensor([expected])), threshold
    assert any(masks(out[:1])[0][3:])  # the low threshold did remove tokens


def test_the_three_chain_in_llama_cpps_order_and_other_rows_stay_bit_identical():
    logits = random_logits(4, seed=3, scale=1.5)
    before = logits.clone()
    t = truncation([1, 3], sigma=[2.0, 1.5], typical=[0.9, 0.95], thr=[0.05, 0.1], prob=[1, 1])
    out = truncate(logits, t, any_draws(logits))
    for row, (n, p, thr) in ((1, (2.0, 0.9, 0.05)), (3, (1.5, 0.95, 0.1))):
        expected = ref_xtc(ref_typical(ref_top_n_sigma(before[row].double().tolist(), n), p), thr)
        assert masks(out[row : row + 1]) == masks(torch.tensor([expected]))
    assert torch.equal(out[0], before[0]) and torch.equal(out[2], before[2])
    assert torch.equal(logits, before)  # the input is not written


def test_xtc_fires_at_its_probability_and_a_seeded_row_repeats():
    logits = random_logits(1, seed=4, scale=1.0).expand(4000, VOCAB).contiguous()
    t = truncation(list(range(4000)), thr=[0.02] * 4000, prob=[0.3] * 4000)
    fired = masks(truncate(logits, t, any_draws(logits)))
    share = sum(any(row[3:]) for row in fired) / 4000
    assert share == pytest.approx(0.3, abs=0.04)
    one = truncation([0], thr=[0.02], prob=[0.5])
    runs = [
        [
            masks(truncate(logits[:1], one, torch.from_numpy(seeded_draws([7], [position]))))[0]
            for position in range(20)
        ]
        for _ in range(2)
    ]
    assert runs[0] == runs[1] and len({tuple(m) for m in runs[0]}) == 2  # fired sometimes


def test_sampled_tokens_stay_in_the_truncated_set_and_greedy_rows_ignore_it():
    logits = random_logits(2, seed=5, scale=2.0)
    kept = [
        i
        for i, dead in enumerate(
            masks(truncate(logits, truncation([0], sigma=[1.0]), any_draws(logits)))[0]
        )
        if not dead
    ]
    meta = make_meta([1.0, 0.0], VOCAB)
    meta = type(meta)(**{**meta.__dict__, "truncation": truncation([0], sigma=[1.0])})
    for _ in range(50):
        token_ids = sample(logits.clone(), redraw(meta)).token_ids.tolist()
        assert token_ids[0] in kept
        assert token_ids[1] == int(logits[1].argmax())


@pytest.mark.parametrize(
    ("field", "value", "rule"),
    [
        ("typical_p", 0.0, "in \\(0, 1\\]"),
        ("typical_p", 1.5, "in \\(0, 1\\]"),
        ("xtc_probability", -0.1, "in \\[0, 1\\]"),
        ("xtc_threshold", 2.0, "in \\[0, 1\\]"),
        ("top_n_sigma", math.inf, "finite"),
    ],
)
def test_bad_values_are_clear_errors(field, value, rule):
    with pytest.raises(ValueError, match=f"{field}=.*{rule}"):
        SamplingParams(**{field: value})
    assert not SamplingParams().truncates
