"""The Grafana dashboard (deploy/grafana/quanta.json) asks only for metrics the server exports.

Every PromQL expression of the dashboard (its panels' and its variables') is reduced to the
metric names it selects; the live test then scrapes the shared tritonserver (the engine's
metrics) and a gateway in front of it (the gateway's), after traffic that makes every lazily
created series appear (a tenant's latencies, a throttled request, a refused one), and checks
each name against what the scrapes hold, parsed with Prometheus' own text parser.
"""

from __future__ import annotations

import contextlib
import json
import re
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from serving import wait_for

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "quanta.json"

# PromQL words that are not metric names: aggregations, functions, keywords.
# fmt: off
_KEYWORDS = frozenset({
    "sum", "min", "max", "avg", "count", "stddev", "stdvar", "topk", "bottomk", "quantile",
    "count_values", "group", "by", "without", "on", "ignoring", "group_left", "group_right",
    "bool", "and", "or", "unless", "offset", "rate", "irate", "increase", "delta",
    "histogram_quantile", "abs", "ceil", "floor", "round", "clamp_min", "clamp_max",
    "label_values", "vector", "scalar", "time", "absent", "avg_over_time", "max_over_time",
    "min_over_time", "sum_over_time", "inf", "nan",
})
# fmt: on
_IDENT = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def metric_names(expr: str) -> set[str]:
    """The metric names ``expr`` selects: its identifiers once label matchers, range
    selectors, grouping lists, strings and Grafana variables are taken out."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # ranges
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)
    text = re.sub(r"\$\{?\w+\}?", "", text)  # Grafana variables
    text = re.sub(r"label_values\(\s*([a-zA-Z_:][\w:]*)\s*,\s*\w+\s*\)", r"\1", text)
    return {w for w in _IDENT.findall(text) if w not in _KEYWORDS and not w[0].isdigit()}


def expressions(dashboard: dict[str, Any]) -> list[str]:
    exprs = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", ()):
            exprs.append(target["expr"])
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            exprs.append(variable["query"]["query"])
    return exprs


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def test_the_name_extraction_reads_promql():
    expr = (
        'sum by (tenant) (rate(quanta_x_total{tenant=~"$tenant", a="b"}[$__rate_interval]))'
        " / ignoring (tenant) group_left sum(rate(quanta_y_total[5m]))"
    )
    assert metric_names(expr) == {"quanta_x_total", "quanta_y_total"}
    assert metric_names("label_values(quanta_z_total, tenant)") == {"quanta_z_total"}
    q = "histogram_quantile(0.95, sum by (le, route) (rate(h_bucket[1m])))"
    assert metric_names(q) == {"h_bucket"}


def test_every_panel_asks_prometheus_and_covers_the_tenant_and_class_views():
    board = dashboard()
    titles = " ".join(p["title"].lower() for p in board["panels"])
    for topic in (
        "throughput",
        "time to first token",
        "time per output token",
        "queue",
        "preemption",
        "throttled",
        "fairness",
        "kv-cache",
        "healthy",
    ):
        assert topic in titles, topic
    variables = {v["name"] for v in board["templating"]["list"]}
    assert {"datasource", "tenant", "priority_class"} <= variables
    for panel in board["panels"]:
        if panel["type"] != "row":
            assert panel["targets"], panel["title"]
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))


def _scrape_names(url: str) -> set[str]:
    with urllib.request.urlopen(url, timeout=10) as answer:
        text = answer.read().decode()
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


def _post(url: str, body: dict[str, Any]) -> int:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            answer.read()
            return answer.status
    except urllib.error.HTTPError as exc:
        exc.read()
        return exc.code


def test_the_dashboard_names_only_metrics_the_server_exports(triton):
    wanted = set().union(*(metric_names(e) for e in expressions(dashboard())))
    assert len(wanted) > 20
    gateway = triton.openai_url().removesuffix("/v1")
    throttling = triton.openai_url("quanta-rpm").removesuffix("/v1")
    chat = {
        "model": "quanta",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 4,
        "user": "dashboard",
    }
    assert _post(f"{gateway}/v1/chat/completions", chat) == 200
    assert _post(f"{gateway}/v1/chat/completions", {**chat, "max_tokens": -1}) == 400
    limited = {"model": "quanta-rpm", "prompt": "hi", "max_tokens": 2, "user": "dashboard-rpm"}
    statuses = [_post(f"{throttling}/v1/completions", limited) for _ in range(2)]
    assert statuses == [200, 429]

    found: set[str] = set()

    def exported() -> bool:  # the engine's metrics reach Triton every metrics interval
        found.update(_scrape_names(triton.metrics_url), _scrape_names(f"{gateway}/metrics"))
        return wanted <= found

    with contextlib.suppress(AssertionError):
        wait_for(exported, what="every metric the dashboard names", timeout=30)
    assert wanted <= found, f"the dashboard names metrics nobody exports: {wanted - found}"
