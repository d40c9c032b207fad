"""The Grafana dashboard and the Prometheus config in `examples/`, checked against a real
`met serve`: every series a panel's query reads is in `/metrics`, and every label a query
filters or groups by is one that series carries.

Queries are read with regular expressions, not a PromQL parser: the dashboard's queries are
plain selectors inside `rate`, `sum by` and `histogram_quantile`, and the regexes cover exactly
those forms.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types import CompletionUsage
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import MODEL_NAME, RunningServer, start_server, stop_server

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD_PATH = ROOT / "examples" / "grafana" / "metrale.json"
PROMETHEUS_CONFIG_PATH = ROOT / "examples" / "prometheus.yml"
DATASOURCE_UID = "${DS_PROMETHEUS}"
MODEL_FILTER = 'model_name="$model_name"'

# Prometheus' metric-name grammar after the prefix: digits too (`e2e_request_latency_seconds`).
METRIC_NAME = re.compile(r"metrale:[a-zA-Z0-9_:]+")
SELECTOR = re.compile(r"(metrale:[a-zA-Z0-9_:]+)\s*\{([^}]*)\}")
MATCHER = re.compile(r'([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)\s*"')
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")

GET_TIME = {
    "name": "get_time",
    "description": "The time",
    "parameters": {
        "type": "object",
        "properties": {"zone": {"enum": ["utc", "local"]}},
        "additionalProperties": False,
    },
}
# The flags of the servers these tests start: hermes so the forced call counts a tool call.
SERVE_FLAGS = ("--tool-call-parser", "hermes")


# -- the dashboard ---------------------------------------------------------------------------


def load_dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD_PATH.read_text())


def all_panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, those folded inside a collapsed row included."""
    panels = []
    for panel in dashboard["panels"]:
        panels.append(panel)
        panels.extend(panel.get("panels", []))
    return panels


def panel_exprs(dashboard: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in all_panels(dashboard) for t in p.get("targets", [])]


def metric_names(expr: str) -> set[str]:
    return set(METRIC_NAME.findall(expr))


# -- the server and its exposition -----------------------------------------------------------


@dataclass(frozen=True)
class Exposition:
    """One scrape of `/metrics`: the label names each sample name carries (over all its
    series), the family each sample belongs to, and the values of the series."""

    labels_by_sample: dict[str, frozenset[str]]
    family_by_sample: dict[str, str]
    values: dict[tuple[str, frozenset[tuple[str, str]]], float]

    def total(self, sample_name: str) -> float:
        return sum(v for (name, _), v in self.values.items() if name == sample_name)


def scrape(server: RunningServer) -> Exposition:
    response = httpx.get(server.base_url + "/metrics", timeout=10)
    assert response.status_code == 200, response.text
    labels: dict[str, set[str]] = {}
    families, values = {}, {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            labels.setdefault(sample.name, set()).update(sample.labels)
            families[sample.name] = family.name
            values[sample.name, frozenset(sample.labels.items())] = sample.value
    frozen = {name: frozenset(names) for name, names in labels.items()}
    return Exposition(frozen, families, values)


def wait_until_counted(
    server: RunningServer, num_requests: int, timeout_s: float = 30.0
) -> Exposition:
    """Scrape until `num_requests` requests have finished and none is running: the counters
    of a request are final by then."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = scrape(server)
        finished = now.total("metrale:request_success_total")
        running = now.total("metrale:num_requests_running")
        if (finished, running) == (num_requests, 0):
            return now
        assert time.monotonic() < deadline, (
            f"after {timeout_s:.0f} s /metrics counts {finished:.0f} finished requests of "
            f"{num_requests} and {running:.0f} running"
        )
        time.sleep(0.05)


def send_known_traffic(server: RunningServer) -> list[CompletionUsage]:
    """One request for a model the server does not serve (a 404, for the error panel), four
    chats, one forced tool call and three completions; the usage of each served request."""
    client = openai.OpenAI(base_url=server.api_url, api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "hi"}], max_tokens=1
        )
    usages = []
    for i in range(4):
        reply = client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": f"Say {i}."}],
            max_tokens=8,
            temperature=0,
        )
        usages.append(reply.usage)
    called = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "What time is it?"}],
        tools=[{"type": "function", "function": GET_TIME}],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=40,
        temperature=0,
    )
    assert called.choices[0].message.tool_calls, called
    usages.append(called.usage)
    for i in range(3):
        reply = client.completions.create(
            model=MODEL_NAME, prompt=f"Count to {i + 2}:", max_tokens=8, temperature=0
        )
        usages.append(reply.usage)
    assert all(u is not None for u in usages)
    return usages


@pytest.fixture(scope="module")
def served(qwen3_dir, tmp_path_factory) -> Iterator[RunningServer]:
    running = start_server(
        qwen3_dir, tmp_path_factory.mktemp("dashboard") / "server.log", *SERVE_FLAGS
    )
    yield running
    assert stop_server(running) == 0, running.log()


@pytest.fixture(scope="module")
def exposition(served: RunningServer) -> Exposition:
    """`/metrics` once the known traffic is counted, so every histogram has samples."""
    usages = send_known_traffic(served)
    return wait_until_counted(served, len(usages))


# -- (a) the dashboard reads what the server exposes -----------------------------------------


def test_every_series_the_dashboard_reads_is_exposed(exposition):
    dashboard = load_dashboard()
    referenced = set().union(*(metric_names(e) for e in panel_exprs(dashboard)))
    missing = sorted(referenced - exposition.labels_by_sample.keys())
    assert not missing, f"the dashboard reads series /metrics does not have: {missing}"
    families = {exposition.family_by_sample[name] for name in referenced}
    # A floor: a regex that stopped matching would otherwise pass on an empty set.
    assert len(families) >= 20, sorted(families)


def test_the_model_variable_reads_an_exposed_series(exposition):
    (variable,) = [v for v in load_dashboard()["templating"]["list"] if v["name"] == "model_name"]
    assert variable["definition"] == "label_values(metrale:num_requests_running, model_name)"
    assert "model_name" in exposition.labels_by_sample["metrale:num_requests_running"]


def test_every_query_filters_and_groups_by_labels_the_series_has(exposition):
    for expr in panel_exprs(load_dashboard()):
        names = metric_names(expr)
        selectors = SELECTOR.findall(expr)
        # Every series is selected with a label filter, so no bare name escapes the check.
        assert len(selectors) == len(METRIC_NAME.findall(expr)), expr
        for name, matchers in selectors:
            used = set(MATCHER.findall(matchers))
            unknown = used - exposition.labels_by_sample[name]
            assert not unknown, f"{expr}: {name} has no label {sorted(unknown)}"
        available = set().union(*(exposition.labels_by_sample[n] for n in names))
        for grouping in GROUPING.findall(expr):
            grouped = {label.strip() for label in grouping.split(",") if label.strip()}
            assert grouped <= available, f"{expr}: groups by {sorted(grouped - available)}"


def test_every_query_is_filtered_by_the_model():
    for expr in panel_exprs(load_dashboard()):
        for name, matchers in SELECTOR.findall(expr):
            assert MODEL_FILTER in matchers, f"{expr}: {name} is not filtered by the model"


def test_the_error_panel_has_a_series_to_show(exposition):
    statuses = {
        dict(labels)["status"]
        for (name, labels), _ in exposition.values.items()
        if name == "metrale:http_requests_total"
    }
    assert any(re.fullmatch("4..|5..", s) for s in statuses), statuses


# -- (b) the dashboard is a well-formed Grafana model ----------------------------------------


def test_the_dashboard_is_json_with_unique_panel_ids():
    dashboard = load_dashboard()  # raises on invalid JSON
    assert 36 <= dashboard["schemaVersion"] <= 41
    ids = [p["id"] for p in all_panels(dashboard)]
    assert len(ids) == len(set(ids)), ids
    assert all(p.get("targets") for p in all_panels(dashboard) if p["type"] != "row")
    kinds = {p["type"] for p in all_panels(dashboard)}
    assert kinds <= {"row", "timeseries", "stat", "gauge", "heatmap", "bargauge", "table"}


def test_every_panel_reads_the_prometheus_variable():
    dashboard = load_dashboard()
    (source,) = [v for v in dashboard["templating"]["list"] if v["type"] == "datasource"]
    assert source["name"] == "DS_PROMETHEUS" and source["query"] == "prometheus"
    assert [i["name"] for i in dashboard["__inputs"]] == ["DS_PROMETHEUS"]
    expected = {"type": "prometheus", "uid": DATASOURCE_UID}
    for panel in all_panels(dashboard):
        assert panel["datasource"] == expected, panel["title"]
        for target in panel.get("targets", []):
            assert target["datasource"] == expected, (panel["title"], target["refId"])
    (model,) = [v for v in dashboard["templating"]["list"] if v["name"] == "model_name"]
    assert model["datasource"] == expected


# -- (c) the Prometheus config ---------------------------------------------------------------


def test_the_prometheus_config_scrapes_met_serve(tmp_path):
    yaml = pytest.importorskip("yaml", reason="PyYAML is not installed: pip install pyyaml")
    config = yaml.safe_load(PROMETHEUS_CONFIG_PATH.read_text())
    assert config["global"]["scrape_interval"] == "5s"
    (job,) = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"] == [{"targets": ["localhost:8000"]}]

    promtool = shutil.which("promtool")
    if promtool is None:
        return
    # The commented authorization block, uncommented, is valid too.
    key_path = tmp_path / "metrale-api-key"
    key_path.write_text("sk-test\n")
    text = PROMETHEUS_CONFIG_PATH.read_text()
    guarded = re.sub(r"(?m)^    # (authorization:|  \w+: )", r"    \1", text)
    guarded = guarded.replace("/etc/prometheus/metrale-api-key", str(key_path))
    assert yaml.safe_load(guarded)["scrape_configs"][0]["authorization"]["type"] == "Bearer"
    for name, body in (("plain.yml", text), ("guarded.yml", guarded)):
        (tmp_path / name).write_text(body)
        done = subprocess.run(
            [promtool, "check", "config", str(tmp_path / name)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, f"{name}:\n{done.stdout}{done.stderr}"
