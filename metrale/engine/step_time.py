"""How long a step takes for the prompt tokens it prefills, learned from the steps run.

A step's time, as a decoding request sees it (the time between its tokens), is modelled as
`base_s + s_per_token * prefill_tokens`: `base_s` is what the step's decodes cost, the slope what
each prompt token adds. Both are fit by least squares over the recent steps, each step's weight
decaying by `DECAY` per step after it, so the fit follows the batch as it grows and shrinks.
The slai policy asks it how many prompt tokens a step can take and still end within the
deadline (`scheduling_policy.py`). It knows nothing until it has seen steps of two different
prefill sizes (a decode-only step and a mixed one will do).
"""

from __future__ import annotations

DECAY = 0.98  # per step: a step 35 steps ago counts half


class StepTimeModel:
    def __init__(self) -> None:
        # decayed sums over the steps seen: weight, p, p^2, t, p*t (p prefill tokens, t seconds)
        self._w = self._p = self._pp = self._t = self._pt = 0.0

    def observe(self, prefill_tokens: int, seconds: float) -> None:
        p, t = float(prefill_tokens), seconds
        self._w = DECAY * self._w + 1.0
        self._p = DECAY * self._p + p
        self._pp = DECAY * self._pp + p * p
        self._t = DECAY * self._t + t
        self._pt = DECAY * self._pt + p * t

    def fit(self) -> tuple[float, float] | None:
        """(base_s, s_per_token), or None while the steps seen cannot tell them apart (all of
        one prefill size) or show no cost per token."""
        spread = self._w * self._pp - self._p * self._p
        if spread <= 1e-6 * max(self._w * self._pp, 1.0):
            return None
        slope = (self._w * self._pt - self._p * self._t) / spread
        if slope <= 0:
            return None
        return (self._t - slope * self._p) / self._w, slope

    def prefill_tokens_within(self, seconds: float) -> int | None:
        """The most prompt tokens a step can prefill and still take at most `seconds` (0 when
        its decodes alone take that long); None while the model knows nothing."""
        fit = self.fit()
        if fit is None:
            return None
        base_s, s_per_token = fit
        return max(int((seconds - base_s) / s_per_token), 0)
