"""`/metrics` over several API processes: every process's series added up, a silent peer left
out of the scrape rather than holding it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from metrale.telemetry import metrics_peers
from metrale.telemetry.metrics import Metrics
from metrale.telemetry.metrics_peers import MetricsPeers, merge_expositions


def _samples(text: bytes) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text.decode())
        for s in family.samples
    }


def _two() -> tuple[Metrics, Metrics]:
    one, two = Metrics("m", 1024), Metrics("m", 1024)
    one.prompt_tokens.inc(5)
    two.prompt_tokens.inc(7)
    one.time_to_first_token.observe(0.3)
    two.time_to_first_token.observe(3.0)
    one.inter_token_latency.observe(0.02)
    two.inter_token_latency.observe(0.02, 3)
    one.child(one.http_requests, "/v1/completions", "200").inc()
    two.child(two.http_requests, "/v1/chat/completions", "200").inc(2)
    one.kv_cache_usage_perc.set(0.25)  # an engine gauge: set in the first process only
    return one, two


def test_every_sample_is_the_sum_of_the_processes():
    one, two = _two()
    merged = _samples(merge_expositions([one.render()[0], two.render()[0]]))
    a, b = _samples(one.render()[0]), _samples(two.render()[0])
    assert merged.keys() == a.keys() | b.keys()
    for key, value in merged.items():
        assert value == pytest.approx(a.get(key, 0.0) + b.get(key, 0.0)), key
    label = (("model_name", "m"),)
    assert merged[("metrale:prompt_tokens_total", label)] == 12
    assert merged[("metrale:time_to_first_token_seconds_count", label)] == 2
    assert merged[("metrale:inter_token_latency_seconds_count", label)] == 4
    assert merged[("metrale:kv_cache_usage_perc", label)] == 0.25


def test_one_exposition_comes_back_as_it_was():
    one, _ = _two()
    assert merge_expositions([one.render()[0]]) == one.render()[0]


def test_a_scrape_gathers_the_peers_and_leaves_a_silent_one_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(metrics_peers, "PEER_TIMEOUT_MS", 300)
    one, two = _two()

    async def run() -> tuple[list[bytes], list[bytes]]:
        first = MetricsPeers(tmp_path, 0, 3, lambda: one.render()[0])
        second = MetricsPeers(tmp_path, 1, 3, lambda: two.render()[0])
        first.start()
        second.start()  # (process 2 never answers)
        try:
            return await first.gather(), await second.gather()
        finally:
            await first.close()
            await second.close()

    by_first, by_second = asyncio.run(run())
    assert by_first == [two.render()[0]]
    assert by_second == [one.render()[0]]
