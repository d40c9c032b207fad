"""The token buckets behind the per-key rate limits, on a clock the test moves."""

from __future__ import annotations

import math

import pytest

from metrale.server.security.rate_limiter import (
    RateLimiter,
    Refusal,
    TokenBucket,
    format_duration,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_bucket_holds_one_minute_and_refills_continuously():
    bucket = TokenBucket(60, now=0.0)
    assert bucket.take(60, 0.0) == 0  # the whole minute's allowance at once (burst)
    assert bucket.take(1, 0.0) == pytest.approx(1.0)  # one a second comes back
    assert bucket.take(1, 0.5) == pytest.approx(0.5)
    assert bucket.take(1, 1.0) == 0
    assert bucket.remaining(1.0) == 0
    assert bucket.remaining(31.0) == 30
    assert bucket.remaining(10_000.0) == 60  # never more than the capacity


def test_refused_take_takes_nothing():
    bucket = TokenBucket(10, now=0.0)
    assert bucket.take(8, 0.0) == 0
    wait = bucket.take(5, 0.0)
    assert wait == pytest.approx((5 - 2) / (10 / 60))
    assert bucket.remaining(0.0) == 2


def test_more_than_a_minute_never_fits():
    bucket = TokenBucket(100, now=0.0)
    assert bucket.take(101, 0.0) == math.inf
    assert bucket.remaining(0.0) == 100


def test_requests_per_minute_per_client():
    clock = Clock()
    limiter = RateLimiter(requests_per_minute=3, clock=clock)
    assert [limiter.charge_request("a") for _ in range(3)] == [None, None, None]
    refusal = limiter.charge_request("a")
    assert refusal is not None and refusal.kind == "requests" and refusal.limit == 3
    assert refusal.retry_after == 20  # one request refills every 20 s
    assert limiter.charge_request("b") is None  # another client is unaffected
    clock.now += 20
    assert limiter.charge_request("a") is None
    assert limiter.charge_request("a") is not None


def test_tokens_are_charged_and_refunded():
    clock = Clock()
    limiter = RateLimiter(tokens_per_minute=1000, clock=clock)
    assert limiter.charge_tokens("a", 900) is None
    refusal = limiter.charge_tokens("a", 200)
    assert refusal is not None and refusal.kind == "tokens" and refusal.requested == 200
    assert refusal.retry_after == 6  # 100 missing at 1000/60 a second: 6 s
    limiter.refund_tokens("a", 500)  # the first request generated less than it was charged for
    assert limiter.charge_tokens("a", 200) is None
    assert dict(limiter.headers("a"))["x-ratelimit-remaining-tokens"] == "400"


def test_retry_after_is_whole_seconds_at_least_one():
    assert Refusal("requests", 10, 0.01).retry_after == 1
    assert Refusal("requests", 10, 1.2).retry_after == 2
    assert Refusal("tokens", 10, math.inf, 50).retry_after == 60
    assert "too large" in Refusal("tokens", 10, math.inf, 50).message


def test_the_table_of_clients_is_bounded_least_recently_used_first():
    clock = Clock()
    limiter = RateLimiter(requests_per_minute=1, max_keys=100, clock=clock)
    assert limiter.charge_request("kept") is None
    for i in range(10_000):
        limiter.charge_request(f"flood-{i}")
        if i % 50 == 0:
            limiter.charge_request("kept")  # used recently: never the one evicted
    assert limiter.num_clients == 100
    assert limiter.charge_request("kept") is not None  # its bucket was remembered: still empty
    assert limiter.charge_request("flood-0") is None  # forgotten long ago: a full bucket


def test_headers_name_the_limits_that_are_set():
    clock = Clock()
    limiter = RateLimiter(requests_per_minute=10, tokens_per_minute=600, clock=clock)
    limiter.charge_request("a")
    limiter.charge_tokens("a", 60)
    headers = dict(limiter.headers("a"))
    assert headers == {
        "x-ratelimit-limit-requests": "10",
        "x-ratelimit-remaining-requests": "9",
        "x-ratelimit-reset-requests": "6s",
        "x-ratelimit-limit-tokens": "600",
        "x-ratelimit-remaining-tokens": "540",
        "x-ratelimit-reset-tokens": "6s",
    }
    assert RateLimiter(requests_per_minute=10, clock=clock).headers("unknown") == []


@pytest.mark.parametrize(
    ("seconds", "text"), [(0.02, "20ms"), (0, "0ms"), (1, "1s"), (59.2, "1m0s"), (361, "6m1s")]
)
def test_durations_are_written_as_openai_writes_them(seconds, text):
    assert format_duration(seconds) == text


def test_limits_must_be_positive():
    with pytest.raises(ValueError, match="requests_per_minute"):
        RateLimiter(requests_per_minute=0)
    with pytest.raises(ValueError, match="max_keys"):
        RateLimiter(tokens_per_minute=5, max_keys=0)


def test_limiters_that_share_a_file_share_each_client_buckets(tmp_path):
    """Two API processes' limiters (`--api-server-count`): one client's allowance is the
    server's, charged and refunded in either."""
    from metrale.server.security.shared_admission import SharedRateLimiter

    clock = Clock()
    path = tmp_path / "limits.db"
    one = SharedRateLimiter(path, 3, 100, max_keys=2, clock=clock)
    two = SharedRateLimiter(path, 3, 100, max_keys=2, clock=clock)
    try:
        assert one.charge_request("a") is None and two.charge_request("a") is None
        assert one.charge_request("a") is None
        refusal = two.charge_request("a")
        assert refusal is not None and refusal.kind == "requests"
        assert refusal.retry_after_s == pytest.approx(20.0)  # a third of the minute's 3
        assert one.charge_tokens("a", 90) is None
        assert two.charge_tokens("a", 20) is not None  # 10 left, in either
        one.refund_tokens("a", 50)
        assert two.charge_tokens("a", 20) is None  # 60 left after the refund, then 40
        headers = dict(one.headers("a"))
        assert headers["x-ratelimit-remaining-requests"] == "0"
        assert headers["x-ratelimit-remaining-tokens"] == "40"
        clock.now += 20.0  # a request refills
        assert two.charge_request("a") is None
        # The table's bound is the file's: a third client evicts the least recently used.
        clock.now += 1.0
        assert one.charge_request("b") is None
        clock.now += 1.0
        assert two.charge_request("c") is None
        assert one.num_clients == two.num_clients == 2
        assert one.headers("a") == []  # forgotten: "a" was used before "b" and "c"
    finally:
        one.close()
        two.close()
