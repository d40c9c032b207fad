"""A real Prometheus scraping a real `met serve`: after known traffic, the values Prometheus
stored equal the usage the responses reported, and every query of the Grafana dashboard
evaluates in Prometheus to a series.

Prometheus (`/usr/bin/prometheus`, Debian's package) listens on loopback only, scrapes every
second and keeps its TSDB in the test's temporary folder.
"""

from __future__ import annotations

import math
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai.types import CompletionUsage

from tests.server.conftest import MODEL_NAME, RunningServer, free_port, start_server, stop_server
from tests.telemetry.test_dashboard import (
    SERVE_FLAGS,
    load_dashboard,
    panel_exprs,
    send_known_traffic,
    wait_until_counted,
)

pytestmark = pytest.mark.slow

PROMETHEUS = shutil.which("prometheus")
JOB = "metrale"
SCRAPE_INTERVAL_S = 1
# Grafana's variables, as it would fill them in for this model and a 5-minute range.
GRAFANA_VARIABLES = {"$model_name": MODEL_NAME, "$__rate_interval": "1m", "$__range": "5m"}


@dataclass
class RunningPrometheus:
    process: subprocess.Popen
    url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector `expr` evaluates to now; fails on a query Prometheus refuses."""
        response = httpx.get(self.url + "/api/v1/query", params={"query": expr}, timeout=10)
        body = response.json()
        assert response.status_code == 200 and body["status"] == "success", (expr, body)
        assert body["data"]["resultType"] == "vector", (expr, body)
        return body["data"]["result"]

    def value(self, expr: str) -> float | None:
        """The one value of `expr` (a `sum(...)`, say), or None while it has no series."""
        result = self.query(expr)
        assert len(result) <= 1, (expr, result)
        return float(result[0]["value"][1]) if result else None


def write_config(path: Path, server: RunningServer) -> None:
    target = server.base_url.removeprefix("http://")
    path.write_text(
        f"global:\n"
        f"  scrape_interval: {SCRAPE_INTERVAL_S}s\n"
        f"  scrape_timeout: {SCRAPE_INTERVAL_S}s\n"
        f"scrape_configs:\n"
        f"  - job_name: {JOB}\n"
        f"    metrics_path: /metrics\n"
        f"    static_configs:\n"
        f'      - targets: ["{target}"]\n'
    )


@pytest.fixture(scope="module")
def served(qwen3_dir, tmp_path_factory) -> Iterator[RunningServer]:
    running = start_server(
        qwen3_dir, tmp_path_factory.mktemp("scraped") / "server.log", *SERVE_FLAGS
    )
    yield running
    assert stop_server(running) == 0, running.log()


@pytest.fixture(scope="module")
def prometheus(served: RunningServer, tmp_path_factory) -> Iterator[RunningPrometheus]:
    if PROMETHEUS is None:
        pytest.skip("no `prometheus` on PATH: install it (Debian: apt-get install prometheus)")
    folder = tmp_path_factory.mktemp("prometheus")
    write_config(folder / "prometheus.yml", served)
    port = free_port()
    log_path = folder / "prometheus.log"
    cmd = [
        PROMETHEUS,
        f"--config.file={folder / 'prometheus.yml'}",
        f"--storage.tsdb.path={folder / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
    ]
    with log_path.open("w") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    running = RunningPrometheus(process, f"http://127.0.0.1:{port}", log_path)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, (
                f"prometheus exited ({process.returncode}):\n{running.log()}"
            )
            try:
                if httpx.get(running.url + "/-/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"prometheus is not ready:\n{running.log()}"
            time.sleep(0.2)
        yield running
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    assert process.returncode == 0, f"prometheus exited with {process.returncode}:\n{running.log()}"


@pytest.fixture(scope="module")
def usages(served: RunningServer, prometheus: RunningPrometheus) -> list[CompletionUsage]:
    """The known traffic, once Prometheus holds two scrapes taken after all of it was counted
    (two, so a `rate` over the last minute sees the series the traffic created)."""
    sent = send_known_traffic(served)
    wait_until_counted(served, len(sent))
    counted_s = time.time()
    selector = f'metrale:request_success_total{{job="{JOB}"}}'
    deadline = time.monotonic() + 60
    while True:
        finished = prometheus.value(f"sum({selector})")
        scraped_s = prometheus.value(f'max(timestamp(up{{job="{JOB}"}}))')
        if (
            finished == len(sent)
            and scraped_s is not None
            and scraped_s >= counted_s + 2 * SCRAPE_INTERVAL_S
        ):
            return sent
        assert time.monotonic() < deadline, (
            f"after 60 s Prometheus holds {finished} finished requests of {len(sent)}, last "
            f"scraped at {scraped_s} (traffic counted at {counted_s:.3f}):\n{prometheus.log()}"
        )
        time.sleep(0.2)


def test_prometheus_holds_the_exact_counts_of_known_traffic(prometheus, usages):
    job = f'{{job="{JOB}", model_name="{MODEL_NAME}"}}'

    def total(name: str) -> float | None:
        return prometheus.value(f"sum(metrale:{name}{job})")

    assert prometheus.value(f'up{{job="{JOB}"}}') == 1
    assert total("prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert total("generation_tokens_total") == sum(u.completion_tokens for u in usages)
    assert total("request_success_total") == len(usages)
    assert total("time_to_first_token_seconds_count") == len(usages)
    assert total("e2e_request_latency_seconds_count") == len(usages)
    assert total("num_requests_running") == 0
    assert total("num_requests_waiting") == 0


def test_every_dashboard_query_evaluates_to_a_series(prometheus, usages):
    empty = []
    for expr in panel_exprs(load_dashboard()):
        for variable, value in GRAFANA_VARIABLES.items():
            expr = expr.replace(variable, value)
        assert "$" not in expr, f"a Grafana variable this test does not fill in: {expr}"
        result = prometheus.query(expr)
        if not result:
            empty.append(expr)
        for series in result:
            value = float(series["value"][1])
            # A quantile of a histogram with no observations in the window is NaN, never inf.
            assert not math.isinf(value), (expr, series)
    assert not empty, "queries with no series after the traffic:\n" + "\n".join(empty)
