"""Grafana dashboards and Prometheus alerting rules for a kvferry deployment, built as code:
`python -m deploy.monitoring [OUT_DIR]` writes them (default: k8s/components/monitoring/,
where they are committed; tests/deploy/test_monitoring.py fails when they drift and checks
every query against a real Prometheus scraping a live deployment).

Queries read the series every process serves on its metrics port (kvferry/rpc/metrics.py),
and the pod label `app_kubernetes_io_component` (router, prefill, decode) that Prometheus's
Kubernetes service discovery attaches, as docs/deploy-kubernetes.md sets it up. Panels use
Grafana's `$__rate_interval`; alert rules fixed windows.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

OUT_DIR = Path(__file__).resolve().parent.parent / "k8s" / "components" / "monitoring"
RATE = "$__rate_interval"
COMPONENT = "app_kubernetes_io_component"
BY_COMPONENT = "{{" + COMPONENT + "}}"  # a legend naming the role


@dataclass(frozen=True)
class Panel:
    """One time-series panel: its title, unit (Grafana's), and (query, legend) targets."""

    title: str
    unit: str
    targets: tuple[tuple[str, str], ...]
    description: str = ""


def _rate(series: str, by: str = "") -> str:
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} (rate({series}[{RATE}]))"


def _quantiles(histogram: str, qs: tuple[float, ...] = (0.5, 0.9, 0.99)
               ) -> tuple[tuple[str, str], ...]:
    return tuple((f"histogram_quantile({q}, sum by (le) (rate({histogram}_bucket[{RATE}])))",
                  f"p{round(q * 100)}") for q in qs)


def _ratio(numerator: str, denominator: str) -> str:
    return f"{_rate(numerator)} / {_rate(denominator)}"


SERVING = (
    Panel("Requests finished", "reqps", ((_rate("kvferry_requests_finished_total", "reason"),
                                          "{{reason}}"),),
          "Requests that completed per second, by finish reason (router)."),
    Panel("Requests failed", "reqps", ((_rate("kvferry_request_failures_total", "code"),
                                        "{{code}}"),),
          "Requests that ended with an error per second, by gRPC status (router)."),
    Panel("Time to first token", "s", _quantiles("kvferry_time_to_first_token_seconds")),
    Panel("Inter-token latency", "s", _quantiles("kvferry_inter_token_latency_seconds")),
    Panel("End-to-end latency", "s", _quantiles("kvferry_e2e_request_latency_seconds",
                                                (0.5, 0.99))),
    Panel("Where the first token waits (p90)", "s", (
        (_quantiles("kvferry_admission_wait_seconds", (0.9,))[0][0], "admission"),
        (_quantiles("kvferry_request_queue_time_seconds", (0.9,))[0][0], "queue"),
        (_quantiles("kvferry_request_prefill_time_seconds", (0.9,))[0][0], "prefill"),
        (_quantiles("kvferry_kv_transfer_time_seconds", (0.9,))[0][0], "K/V transfer"))),
    Panel("Tokens per second", "short", (
        (_rate("kvferry_prompt_tokens_total"), "prompt"),
        (_rate("kvferry_generation_tokens_total"), "generated"))),
    Panel("Requests on the workers", "short", (
        (f"sum by ({COMPONENT}) (kvferry_num_requests_running)", f"running {BY_COMPONENT}"),
        (f"sum by ({COMPONENT}) (kvferry_num_requests_waiting)",
         f"waiting {BY_COMPONENT}"))),
    Panel("Workers the router sees healthy", "short", (
        ("sum(kvferry_router_worker_healthy)", "healthy"),
        ("count(kvferry_router_worker_healthy)", "known"))),
    Panel("Migrations and prefill retries", "ops", (
        (_rate("kvferry_migrations_total"), "migrations"),
        (_rate("kvferry_prefill_retries_total"), "prefill retries")),
          "A migration moves a running request to another decode worker (its worker lost)."),
)

KV = (
    Panel("K/V pool in use", "percentunit", (
        (f"max by ({COMPONENT}, instance) (kvferry_kv_cache_usage_perc)",
         BY_COMPONENT + " {{instance}}"),)),
    Panel("K/V pool size", "short", (
        (f"sum by ({COMPONENT}) (kvferry_kv_cache_total_blocks)", f"blocks {BY_COMPONENT}"),)),
    Panel("K/V shipped, prefill to decode", "Bps", (
        (_rate("kvferry_kv_bytes_sent_total"), "sent"),
        (_rate("kvferry_kv_bytes_received_total"), "received"))),
    Panel("K/V transfer time", "s", _quantiles("kvferry_kv_transfer_time_seconds", (0.5, 0.99))),
    Panel("Prefix cache hit rate", "percentunit", (
        (_ratio("kvferry_prefix_cache_hits_total", "kvferry_prefix_cache_queries_total"),
         "hits / queries"),)),
    Panel("K/V tier occupancy", "percentunit", (
        ("sum by (tier) (kvferry_kv_tier_blocks) / "
         "sum by (tier) (kvferry_kv_tier_capacity_blocks)", "{{tier}}"),)),
    Panel("K/V tier traffic", "Bps", (
        (_rate("kvferry_kv_tier_bytes_in_total", "tier"), "into {{tier}}"),
        (_rate("kvferry_kv_tier_bytes_out_total", "tier"), "out of {{tier}}"))),
    Panel("Speculative decoding acceptance", "percentunit", (
        (_ratio("kvferry_spec_decode_accepted_tokens_total",
                "kvferry_spec_decode_draft_tokens_total"), "accepted / drafted"),)),
    Panel("Eviction and preemption", "ops", (
        (_rate("kvferry_kv_evicted_blocks_total"), "blocks evicted"),
        (_rate("kvferry_num_preemptions_total"), "preemptions"))),
    Panel("Decode steps", "ops", ((_rate("kvferry_decode_steps_total", "instance"),
                                   "{{instance}}"),)),
)

BOARDS = {"kvferry-serving": ("kvferry: serving", SERVING),
          "kvferry-kv-cache": ("kvferry: K/V cache", KV)}


@dataclass(frozen=True)
class Alert:
    """A rule firing when `series` `op` `threshold` holds for `for_s`."""

    name: str
    series: str
    op: str
    threshold: float
    for_s: int
    severity: str
    summary: str

    @property
    def expr(self) -> str:
        return f"{self.series} {self.op} {self.threshold:g}"


SERVER_ERRORS = 'code=~"INTERNAL|UNAVAILABLE|DEADLINE_EXCEEDED|UNKNOWN"'
ALERTS = (
    Alert("KvferryWorkerUnhealthy", "kvferry_router_worker_healthy", "<", 1, 60, "critical",
          "The router has found worker {{ $labels.worker }} unhealthy for a minute."),
    Alert("KvferryServerErrors",
          f"(sum(rate(kvferry_request_failures_total{{{SERVER_ERRORS}}}[5m])) or vector(0))"
          " / clamp_min(sum(rate(kvferry_requests_finished_total[5m])), 1e-9)", ">", 0.05,
          300, "critical", "Over 5% of requests fail with a server-side error."),
    Alert("KvferryTTFTHigh",
          "histogram_quantile(0.99, sum by (le) "
          "(rate(kvferry_time_to_first_token_seconds_bucket[5m])))", ">", 5, 600, "warning",
          "p99 time to first token above 5 s for 10 minutes."),
    Alert("KvferryITLHigh",
          "histogram_quantile(0.99, sum by (le) "
          "(rate(kvferry_inter_token_latency_seconds_bucket[5m])))", ">", 0.5, 600, "warning",
          "p99 inter-token latency above 500 ms for 10 minutes."),
    Alert("KvferryKvPoolFull", "max by (instance) (kvferry_kv_cache_usage_perc)", ">", 0.95,
          600, "warning", "A worker's K/V pool has been over 95% full for 10 minutes."),
    Alert("KvferryRequestsWaiting", f"sum by ({COMPONENT}) (kvferry_num_requests_waiting)",
          ">", 32, 300, "warning", "Requests queue on the workers: add capacity."),
    Alert("KvferryPreempting", "sum(rate(kvferry_num_preemptions_total[5m]))", ">", 1, 600,
          "warning", "Decode workers preempt over one sequence a second: pools too small."),
    Alert("KvferryCorruptKv", "sum(increase(kvferry_kv_corrupt_pushes_total[10m]))", ">", 0,
          0, "critical", "A K/V push failed its checksum: a link or memory corrupts data."),
    Alert("KvferryMigrating", "sum(rate(kvferry_migrations_total[5m]))", ">", 0.1, 300,
          "warning", "Requests keep migrating: decode workers are being lost."),
)


def dashboard(uid: str, title: str, panels: tuple[Panel, ...]) -> dict[str, object]:
    """A Grafana dashboard (JSON model, schema 39): the panels two to a row."""
    source = {"type": "prometheus", "uid": "${datasource}"}
    return {
        "uid": uid, "title": title, "tags": ["kvferry"], "schemaVersion": 39,
        "time": {"from": "now-1h", "to": "now"}, "refresh": "30s",
        "templating": {"list": [{"name": "datasource", "type": "datasource",
                                 "query": "prometheus", "label": "Prometheus"}]},
        "panels": [{
            "id": i + 1, "type": "timeseries", "title": p.title, "description": p.description,
            "datasource": source,
            "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
            "fieldConfig": {"defaults": {"unit": p.unit}, "overrides": []},
            "targets": [{"refId": chr(ord("A") + j), "datasource": source, "expr": expr,
                         "legendFormat": legend} for j, (expr, legend) in enumerate(p.targets)],
        } for i, p in enumerate(panels)],
    }


def rules_yaml() -> str:
    """The alerting rules as a Prometheus rule file (YAML written by hand: no dependency)."""
    lines = ["groups:", "  - name: kvferry", "    rules:"]
    for a in ALERTS:
        lines += [f"      - alert: {a.name}", f"        expr: {json.dumps(a.expr)}",
                  f"        for: {a.for_s}s", "        labels:",
                  f"          severity: {a.severity}", "        annotations:",
                  f"          summary: {json.dumps(a.summary)}"]
    return "\n".join(lines) + "\n"


def files() -> dict[str, str]:
    """Each file's path under the output directory, and its text."""
    out = {f"dashboards/{uid}.json": json.dumps(dashboard(uid, title, panels), indent=1) + "\n"
           for uid, (title, panels) in BOARDS.items()}
    out["rules/kvferry-alerts.yaml"] = rules_yaml()
    return out


def main(argv: list[str]) -> None:
    out_dir = Path(argv[0]) if argv else OUT_DIR
    for name, text in files().items():
        path = out_dir / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(path)


if __name__ == "__main__":
    main(sys.argv[1:])
