"""What a benchmark reads from the server it drives besides the answers: what the server is
(`/hardware`, `/serve-config`, `/memory`, `/forward` on a Metrale server; absent elsewhere) and
its own latency histograms (`/metrics`: vLLM's names, under the `metrale:` prefix here, `vllm:`
on vLLM, `sglang:` on SGLang), so a run can set the client's view beside the server's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

INFO_ROUTES = ("/hardware", "/serve-config", "/memory", "/forward")
# our name -> the server's histogram names without their prefix, first found wins (vLLM's V0
# name for the ITL last)
SERVER_HISTOGRAMS = {
    "ttft": ("time_to_first_token_seconds",),
    "itl": ("inter_token_latency_seconds", "time_per_output_token_seconds"),
    "tpot": ("request_time_per_output_token_seconds",),
    "e2el": ("e2e_request_latency_seconds",),
}


@dataclass(frozen=True)
class Target:
    name: str
    base_url: str

    @classmethod
    def parse(cls, spec: str) -> Target:
        """`URL` or `NAME=URL`."""
        name, sep, url = spec.partition("=")
        if not sep or "://" in name:
            name, url = "", spec
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--base-url {spec!r}: give http://HOST:PORT or NAME=http://...")
        url = url.rstrip("/").removesuffix("/v1")
        return cls(name or url.split("://", 1)[1], url)


async def server_info(client: httpx.AsyncClient) -> dict[str, Any]:
    """The routes of INFO_ROUTES that answer with JSON (a Metrale server's), by route."""
    info: dict[str, Any] = {}
    for route in INFO_ROUTES:
        try:
            response = await client.get(route, timeout=10)
            if response.status_code == 200:
                info[route.lstrip("/")] = response.json()
        except (httpx.HTTPError, ValueError):
            continue
    return info


async def served_models(client: httpx.AsyncClient) -> list[str]:
    response = await client.get("/v1/models", timeout=10)
    response.raise_for_status()
    return [m["id"] for m in response.json().get("data", []) if isinstance(m, dict) and "id" in m]


@dataclass(frozen=True)
class Scrape:
    """One read of a server's `/metrics`, every series summed over its labels, by its name
    without the prefix (`metrale:`, `vllm:`): histograms as (sum, count), counters' totals."""

    histograms: dict[str, tuple[float, float]]
    counters: dict[str, float]


async def scrape(client: httpx.AsyncClient) -> Scrape | None:
    """The server's `/metrics` now; None when there is no Prometheus `/metrics`."""
    try:
        response = await client.get("/metrics", timeout=10)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    histograms: dict[str, list[float]] = {}
    counters: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(response.text):
            for sample in family.samples:
                name = sample.name.rpartition(":")[2]
                if family.type == "counter" and name.endswith("_total"):
                    name = name.removesuffix("_total")
                    counters[name] = counters.get(name, 0.0) + sample.value
                for suffix, slot in (("_sum", 0), ("_count", 1)):
                    if family.type == "histogram" and name.endswith(suffix):
                        histograms.setdefault(name.removesuffix(suffix), [0.0, 0.0])[slot] += (
                            sample.value
                        )
    except ValueError:
        return None
    return Scrape({name: (v[0], v[1]) for name, v in histograms.items()}, counters)


def server_means(before: Scrape | None, after: Scrape | None) -> dict[str, float]:
    """The server's own mean of each latency over the run, in ms (`server_mean_ttft_ms`, ...)
    from the histograms' growth, and the share of looked-up prompt tokens its prefix cache
    served (`server_prefix_cache_hit_rate`); what the server does not export is left out."""
    if before is None or after is None:
        return {}
    means = {}
    for ours, names in SERVER_HISTOGRAMS.items():
        for name in names:
            if name in after.histograms:
                total, count = after.histograms[name]
                prior = before.histograms.get(name, (0.0, 0.0))
                if count > prior[1]:
                    means[f"server_mean_{ours}_ms"] = 1e3 * (total - prior[0]) / (count - prior[1])
                break
    queries, hits = (
        after.counters.get(k, 0.0) - before.counters.get(k, 0.0)
        for k in ("prefix_cache_queries", "prefix_cache_hits")
    )
    if queries > 0:
        means["server_prefix_cache_hit_rate"] = hits / queries
    return means
