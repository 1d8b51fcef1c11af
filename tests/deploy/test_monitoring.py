"""The shipped dashboards and alerting rules (deploy/monitoring.py, k8s/components/monitoring/):
the committed files are the generator's; the rules pass `promtool`; and a real Prometheus
(Debian's `prometheus` package, which .ci/run installs) scraping a live deployment under load
returns a series for every panel's every query and every alert rule's expression (the part
before its comparison: a rule that is not firing returns nothing, by design)."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy import client
from deploy.launcher import Deployment
from deploy.monitoring import ALERTS, BOARDS, OUT_DIR, RATE, files
from tests.waiting import until_sync

PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
MISSING = ("needs Debian's prometheus package (apt-get install prometheus), as .ci/run "
           "installs it")


def test_the_committed_files_are_the_generators() -> None:
    for name, text in files().items():
        assert (OUT_DIR / name).read_text() == text, f"rerun python -m deploy.monitoring: {name}"


def test_the_rules_pass_promtool() -> None:
    assert PROMTOOL is not None, MISSING
    check = subprocess.run([PROMTOOL, "check", "rules",
                            str(OUT_DIR / "rules" / "kvferry-alerts.yaml")],
                           capture_output=True, text=True, check=False)
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in check.stdout


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _query(port: int, expr: str) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as resp:
        body = json.load(resp)
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]


@pytest.fixture(scope="module")
def watched(qwen3_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[tuple[Deployment, int]]:
    """A deployment (n-gram drafts, a host K/V tier, every metrics port open) and a
    Prometheus scraping each process every second, labelled by role as Kubernetes service
    discovery labels pods."""
    assert PROMETHEUS is not None, MISSING
    logs = tmp_path_factory.mktemp("monitoring")
    deployment = Deployment(
        model=str(qwen3_checkpoint), log_dir=logs,
        router_args=["--metrics-port", "0"],
        worker_args=["--metrics-port", "0", "--speculative-method", "ngram",
                     "--num-speculative-tokens", "4", "--kv-host-cache-size", "32MiB"]).start()
    targets = [{"targets": [f"127.0.0.1:{p.metrics_port}"],
                "labels": {"app_kubernetes_io_component": p.name.split("-")[0]}}
               for p in deployment.processes]
    config = logs / "prometheus.yml"
    config.write_text(json.dumps({  # YAML is a superset of JSON
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(OUT_DIR / "rules" / "kvferry-alerts.yaml")],
        "scrape_configs": [{"job_name": "kvferry", "static_configs": targets}]}))
    port = _free_port()
    server = subprocess.Popen(
        [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={logs / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=(logs / "prometheus.log").open("w"))
    try:
        until_sync(lambda: _ready(port), "Prometheus ready", deadline_s=60)
        yield deployment, port
    finally:
        server.terminate()
        server.wait(30)
        deployment.stop()


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def _load(deployment: Deployment) -> None:
    """Three waves of requests sharing a prefix (prefix hits, host-tier writes) whose
    repeats give n-gram drafts, a second apart, and one refused (a failure by status)."""
    prefix = [7 + i % 13 for i in range(64)]
    for wave in range(3):
        asyncio.run(client.generate_many(deployment.router_address, [
            client.make_request(prefix + [30 + wave, 31 + i], temperature=0.0, max_tokens=24,
                                ignore_eos=True) for i in range(4)], 120))
        time.sleep(1.0)
    with pytest.raises(Exception, match="temperature"):
        asyncio.run(client.generate(deployment.router_address, client.make_request(
            [5], temperature=-1.0, max_tokens=2), 30))


@pytest.mark.slow
def test_every_panel_and_rule_returns_a_series_from_a_live_deployment(
        watched: tuple[Deployment, int]) -> None:
    deployment, port = watched
    _load(deployment)
    queries = [(f"{uid}: {panel.title}", expr.replace(RATE, "1m"))
               for uid, (_, panels) in BOARDS.items() for panel in panels
               for expr, _ in panel.targets]
    queries += [(f"alert {a.name}", a.series) for a in ALERTS]
    until_sync(lambda: all(_query(port, expr) for _, expr in queries[:3]),
               "the load's samples scraped", deadline_s=60)
    time.sleep(3.0)  # a few more scrapes after the last request
    empty = [name for name, expr in queries if not _query(port, expr)]
    assert empty == [], f"queries without a series: {empty}"
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/rules", timeout=10) as resp:
        groups = json.load(resp)["data"]["groups"]
    rules = [r for g in groups for r in g["rules"]]
    assert len(rules) == len(ALERTS) and all(r["health"] == "ok" for r in rules), rules


def test_the_dashboards_are_grafana_json_models() -> None:
    for uid in BOARDS:
        board = json.loads((OUT_DIR / "dashboards" / f"{uid}.json").read_text())
        assert board["uid"] == uid and board["schemaVersion"] >= 36
        ids = [p["id"] for p in board["panels"]]
        assert len(ids) == len(set(ids)) and all(p["targets"] for p in board["panels"])
        assert all(t["expr"] and t["refId"] for p in board["panels"] for t in p["targets"])
        assert Path(OUT_DIR / "kustomization.yaml").read_text().count(f"{uid}.json") == 1
