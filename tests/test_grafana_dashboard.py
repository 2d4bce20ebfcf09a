"""docs/grafana_dashboard.json and docs/monitoring.md against what `GET /metrics` really exposes
(a rendered ServerMetrics, parsed with prometheus_client's own parser). No jax, no compiles."""

from __future__ import annotations

import json
import re

from conftest import REPO  # tests/ is on sys.path
from prometheus_client.parser import text_string_to_metric_families

from serve.metrics import ServerMetrics, idle_engine_stats

DASHBOARD = REPO / "docs" / "grafana_dashboard.json"
MONITORING = REPO / "docs" / "monitoring.md"
METRIC_NAME = re.compile(r"vllm:[A-Za-z0-9_:]+")
# A selector: a metric name and its label matchers, e.g. vllm:x_bucket{model_name="$model_name"}.
SELECTOR = re.compile(r"(vllm:[A-Za-z0-9_:]+)(\{[^}]*\})?")


def exposed() -> tuple[set[str], set[str]]:
    """(sample names, family names) of one /metrics render, as Prometheus would read them, from a
    server with speculative decoding on (k = 2): every series it may expose."""
    stats = idle_engine_stats(num_speculative_tokens=2)
    body, _ = ServerMetrics("dsv4-tiny", lambda: stats).render()
    families = list(text_string_to_metric_families(body.decode()))
    return {s.name for f in families for s in f.samples}, {f.name for f in families}


def queries(dashboard: dict) -> list[str]:
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


def test_dashboard_queries_only_names_the_server_exposes_selected_by_model_name():
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    samples, families = exposed()
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    model_query = variables["model_name"]["query"]["query"]
    used = {name for expr in [*queries(dashboard), model_query] for name in METRIC_NAME.findall(expr)}
    assert used and not used - samples, f"not exposed by /metrics: {sorted(used - samples)}"
    # Every family the server exposes has a panel (the family name is a prefix of its samples').
    unpanelled = {f for f in families if not any(name.startswith(f) for name in used)}
    assert not unpanelled, f"no panel queries {sorted(unpanelled)}"
    for expr in queries(dashboard):
        for name, matchers in SELECTOR.findall(expr):
            assert 'model_name="$model_name"' in matchers, f"{name} in {expr!r} is not selected by $model_name"
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]


def test_monitoring_page_lists_every_exposed_metric():
    text = MONITORING.read_text(encoding="utf-8")
    _, families = exposed()
    listed = {name.removesuffix("_total") for name in METRIC_NAME.findall(text)}
    assert not families - listed, f"docs/monitoring.md does not list {sorted(families - listed)}"


def test_prefix_cache_hit_rate_panel_divides_hits_by_queries():
    """vLLM's hit rate: the rate of cached tokens over the rate of looked-up tokens (a fraction,
    shown as a percentage), not their cumulative totals (which would hide a change of workload)."""
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    (panel,) = [p for p in dashboard["panels"] if p["title"] == "Prefix cache hit rate"]
    (expr,) = [t["expr"] for t in panel["targets"]]
    numerator, denominator = expr.split("\n/\n")
    assert METRIC_NAME.findall(numerator) == ["vllm:prefix_cache_hits_total"]
    assert METRIC_NAME.findall(denominator) == ["vllm:prefix_cache_queries_total"]
    assert numerator.startswith("rate(") and denominator.startswith("rate(")
    defaults = panel["fieldConfig"]["defaults"]
    assert (defaults["unit"], defaults["min"], defaults["max"]) == ("percentunit", 0, 1)


def test_spec_decode_panel_divides_accepted_by_drafted_overall_and_per_position():
    """vLLM's acceptance rate, rate(accepted tokens) / rate(draft tokens), and its per-position
    rate, rate(accepted at position i) / rate(drafts), matched on every label but `position`."""
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    (panel,) = [p for p in dashboard["panels"] if p["title"] == "Speculative decoding acceptance"]
    overall, per_position = panel["targets"]
    numerator, denominator = overall["expr"].split("\n/\n")
    assert METRIC_NAME.findall(numerator) == ["vllm:spec_decode_num_accepted_tokens_total"]
    assert METRIC_NAME.findall(denominator) == ["vllm:spec_decode_num_draft_tokens_total"]
    numerator, operator, denominator = per_position["expr"].split("\n")
    assert METRIC_NAME.findall(numerator) == ["vllm:spec_decode_num_accepted_tokens_per_pos_total"]
    assert operator == "/ ignoring(position) group_left"  # one drafts series over k per-position ones
    assert METRIC_NAME.findall(denominator) == ["vllm:spec_decode_num_drafts_total"]
    for expr in (overall["expr"], per_position["expr"]):
        assert all(part.startswith("rate(") for part in expr.split("\n")[::2]), expr
    assert "{{position}}" in per_position["legendFormat"]
    defaults = panel["fieldConfig"]["defaults"]
    assert (defaults["unit"], defaults["min"], defaults["max"]) == ("percentunit", 0, 1)
    # Beside the prefix cache panel, overlapping none.
    boxes = [(p["gridPos"]["x"], p["gridPos"]["y"]) for p in dashboard["panels"]]
    assert len(set(boxes)) == len(boxes)
