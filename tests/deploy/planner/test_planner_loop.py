"""The live planner process: what it reads from the routers' metrics, what it decides and
exports, and the Kubernetes requests it sends, through the real `kubernetes` client with its
HTTP layer replaced, validated offline against the API schema."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import kubernetes_validate
import pytest
from kubernetes import client as k8s
from prometheus_client import CollectorRegistry, generate_latest

from deploy.cli import main
from deploy.planner.live import Bounds, Planner
from deploy.planner.loop import PlannerLoop, PlannerMetrics
from deploy.planner.observe import (
    Scrape,
    interval_fault,
    merge,
    observation,
    parse,
    percentile_ms,
    scraper,
)
from deploy.planner.scalers import (
    KubernetesScaler,
    RayScaler,
    replicas_patch,
    scale_object,
)
from deploy.planner.search import Sla
from kvferry.rpc.grpc_util import free_port
from kvferry.rpc.metrics import RouterMetrics
from tests.deploy.planner.synthetic import make_cost, make_profile

K8S_VERSION = "1.30.0"  # tests/k8s validate the manifests against the same schemas


class Router:
    """A router's metrics registry, fed as the router feeds it."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.metrics = RouterMetrics(self.registry)

    def serve(self, count: int, prompt: int, output: int, ttft_s: float, itl_s: float
              ) -> None:
        for _ in range(count):
            self.metrics.finished.labels("length").inc()
            self.metrics.prompt_tokens.inc(prompt)
            self.metrics.generation_tokens.inc(output)
            self.metrics.ttft.observe(ttft_s)
            for _ in range(output - 1):
                self.metrics.itl.observe(itl_s)

    def scrape(self, at_s: float) -> Scrape:
        return parse(generate_latest(self.registry).decode(), at_s)


def test_an_interval_is_the_difference_of_two_scrapes() -> None:
    router = Router()
    router.serve(5, 1000, 10, 0.2, 0.01)
    before = router.scrape(0.0)
    router.serve(20, 100, 50, 0.04, 0.02)
    after = router.scrape(10.0)
    obs = observation(before, after)
    assert (obs.duration_s, obs.num_requests, obs.lengths) == (10.0, 20, ((100, 50),))
    assert obs.rate == pytest.approx(2.0)
    # this interval's only, within the bucket they fall in (40 ms: (20, 40]; 20: (10, 20])
    assert 20 < percentile_ms(before, after, "ttft", 90) <= 40
    assert 10 < percentile_ms(before, after, "itl", 50) <= 20
    assert dict(observation(before, after, [("ttft", 90.0)]).latencies_ms).keys() == {"ttft"}
    assert observation(after, after).num_requests == 0


def test_a_percentile_is_interpolated_within_its_bucket() -> None:
    """As Prometheus' histogram_quantile: 10 observations in (40, 60] ms and 10 in (60, 80]:
    the median is the (40, 60] bucket's top, p75 halfway up the next; past the last finite
    bucket, that bucket's bound."""
    router = Router()
    before = router.scrape(0.0)
    for seconds in [0.05] * 10 + [0.07] * 10:
        router.metrics.ttft.observe(seconds)
    after = router.scrape(1.0)
    assert percentile_ms(before, after, "ttft", 50) == pytest.approx(60.0)
    assert percentile_ms(before, after, "ttft", 75) == pytest.approx(70.0)
    router.metrics.ttft.observe(1e6)
    assert percentile_ms(before, router.scrape(2.0), "ttft", 100) == pytest.approx(
        max(b for b, _ in after.buckets["ttft"] if b != float("inf")) * 1000)


def test_two_routers_add_up_and_a_restart_reads_as_nothing() -> None:
    a, b = Router(), Router()
    a.serve(3, 100, 10, 0.1, 0.01)
    b.serve(1, 500, 10, 0.1, 0.01)
    both = merge([a.scrape(1.0), b.scrape(2.0)])
    assert (both.at_s, both.finished, both.prompt_tokens) == (2.0, 4, 800)
    restarted = Router()
    restarted.serve(1, 10, 2, 0.1, 0.01)
    assert observation(both, restarted.scrape(3.0)).num_requests == 0


class FakeScaler:
    def __init__(self, prefill: int, decode: int) -> None:
        self.counts = (prefill, decode)
        self.calls: list[tuple[int, int]] = []

    def current(self) -> tuple[int, int]:
        return self.counts

    def scale(self, num_prefill: int, num_decode: int) -> None:
        self.calls.append((num_prefill, num_decode))
        self.counts = (num_prefill, num_decode)


def test_the_loop_scales_after_its_patience_and_exports_why() -> None:
    router, clock = Router(), iter(range(0, 1000, 10))
    registry = CollectorRegistry()
    scaler = FakeScaler(1, 1)

    def scrape() -> dict[str, Scrape]:
        router.serve(40, 32, 300, 0.1, 0.02)  # 4 requests/s of long answers
        return {"router": router.scrape(float(next(clock)))}

    planner = Planner(make_cost(), Sla.parse("ttft-p90=500,itl-p90=15"),
                      Bounds(max_prefill=3, max_decode=3, max_workers=4), patience=2)
    loop = PlannerLoop(planner, scrape, scaler, PlannerMetrics(registry))
    assert loop.run_once() is None  # the first scrape only
    held = loop.run_once()
    assert held is not None and "waiting 1 more" in held.reason and scaler.calls == []
    moved = loop.run_once()
    assert moved is not None and scaler.calls == [(1, 2)]
    value = registry.get_sample_value
    assert value("kvferry_planner_workers", {"role": "decode", "kind": "target"}) == 2
    assert value("kvferry_planner_workers", {"role": "decode", "kind": "current"}) == 1
    assert value("kvferry_planner_decisions_total", {"action": "scale_up"}) == 1
    assert value("kvferry_planner_decisions_total", {"action": "hold"}) == 1
    assert value("kvferry_planner_observed_request_rate") == pytest.approx(4.0)
    dry = PlannerLoop(planner, scrape, FakeScaler(1, 1), PlannerMetrics(CollectorRegistry()),
                      is_dry_run=True)
    for _ in range(4):
        dry.run_once()
    assert dry.scaler.calls == []


def _planner() -> Planner:
    return Planner(make_cost(), Sla.parse("ttft-p90=500,itl-p90=15"),
                   Bounds(max_prefill=3, max_decode=3, max_workers=4), patience=2)


@contextmanager
def _metrics_server(routes: dict[str, bytes]) -> Iterator[str]:
    """An HTTP server answering each path of `routes` with its body (404 otherwise)."""
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            body = routes.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.send_header("Content-Length", str(len(body or b"")))
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args: object) -> None:
            pass  # the test's output stays quiet

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_the_scrape_keeps_the_routers_that_answer_within_the_cap(
        caplog: pytest.LogCaptureFixture) -> None:
    """An unreachable router, an error, a body past the cap and a text that is no metrics
    text each leave their router out of the interval (logged); the others are kept."""
    router = Router()
    router.serve(2, 100, 10, 0.1, 0.01)
    text = generate_latest(router.registry)
    with _metrics_server({"/ok": text, "/huge": text + b"#" * 64, "/junk": b"\xff\xfe{"}) as base:
        urls = [f"{base}/ok", f"http://127.0.0.1:{free_port()}/metrics", f"{base}/missing",
                f"{base}/huge", f"{base}/junk"]
        with caplog.at_level(logging.WARNING, logger="kvferry.planner"):
            got = scraper(lambda: urls, lambda: 1.0, timeout_s=5,
                          max_body_bytes=len(text) + 32)()
    assert list(got) == [f"{base}/ok"] and got[f"{base}/ok"].finished == 2
    for url in urls[1:]:
        assert f"router {url} left out" in caplog.text
    assert "more than" in caplog.text  # the cap, said
    with caplog.at_level(logging.WARNING, logger="kvferry.planner"):
        assert scraper(lambda: _unresolvable(), lambda: 1.0)() == {}
    assert "cannot list the routers" in caplog.text


def _unresolvable() -> list[str]:
    raise OSError("Name or service not known")


def test_nan_and_restarted_counters_are_no_interval() -> None:
    router = Router()
    router.serve(3, 100, 10, 0.1, 0.01)
    before = router.scrape(0.0)
    router.serve(1, 100, 10, 0.1, 0.01)
    after = router.scrape(1.0)
    assert interval_fault(before, after) is None
    assert "went down" in interval_fault(after, Router().scrape(2.0))  # restarted
    nan = Scrape(1.0, float("nan"), after.prompt_tokens, after.generation_tokens, after.buckets)
    assert "finite" in interval_fault(before, nan)
    assert observation(before, nan).num_requests == 0  # NaN reads as nothing, never as NaN
    negative = Scrape(0.5, -5.0, -1.0, -1.0, {})
    assert "non-negative" in interval_fault(negative, after)
    assert "no time passed" in interval_fault(after, after)
    ttft = tuple((le, 0.0 if le < 1 else c) for le, c in after.buckets["ttft"])
    not_cumulative = Scrape(1.0, after.finished, after.prompt_tokens,
                            after.generation_tokens, {**after.buckets, "ttft": ttft})
    assert "histogram ttft" in interval_fault(before, not_cumulative)


def test_the_loop_plans_from_the_routers_that_answer(caplog: pytest.LogCaptureFixture) -> None:
    """Two routers each serving 2 requests/s: one unreachable, restarted or sending NaN is
    left out (the plan reads the other's 2/s); none answering twice in a row: no decision."""
    routers, clock = {"a": Router(), "b": Router()}, iter(range(0, 1000, 10))
    answering = {"a", "b"}
    broken: dict[str, Callable[[Scrape], Scrape]] = {}  # this interval's answer, altered

    def scrape() -> dict[str, Scrape]:
        at = float(next(clock))
        for router in routers.values():
            router.serve(20, 32, 300, 0.1, 0.02)
        scrapes = {name: router.scrape(at) for name, router in routers.items()}
        scrapes.update({name: alter(scrapes[name]) for name, alter in broken.items()})
        broken.clear()
        return {name: scrapes[name] for name in sorted(answering)}

    scaler = FakeScaler(1, 1)
    registry = CollectorRegistry()
    loop = PlannerLoop(_planner(), scrape, scaler, PlannerMetrics(registry))

    def rate() -> float | None:
        return registry.get_sample_value("kvferry_planner_observed_request_rate")

    assert loop.run_once() is None  # baselines
    assert loop.run_once() is not None and rate() == pytest.approx(4.0)
    answering.discard("b")
    with caplog.at_level(logging.WARNING, logger="kvferry.planner"):
        assert loop.run_once() is not None and rate() == pytest.approx(2.0)
        answering.add("b")  # back: its first answer is a baseline again
        assert loop.run_once() is not None and rate() == pytest.approx(2.0)
        assert loop.run_once() is not None and rate() == pytest.approx(4.0)
        routers["b"] = Router()  # restarted: its counters start again from zero
        assert loop.run_once() is not None and rate() == pytest.approx(2.0)
        assert "router b left out this interval: a counter went down" in caplog.text
        loop.run_once()  # from b's fresh baseline: a sound interval again
        assert rate() == pytest.approx(4.0)
        caplog.clear()
        broken["b"] = lambda got: Scrape(got.at_s, float("nan"), got.prompt_tokens,
                                         got.generation_tokens, got.buckets)
        assert loop.run_once() is not None and rate() == pytest.approx(2.0)
        assert "router b left out this interval: a value is not a finite" in caplog.text
        answering.clear()
        calls = list(scaler.calls)
        assert loop.run_once() is None and loop.run_once() is None
        assert "no decision" in caplog.text and scaler.calls == calls


class Recorded:
    """The HTTP layer under the kubernetes client: records each request, answers a Scale."""

    def __init__(self, replicas: int) -> None:
        self.replicas = replicas
        self.requests: list[tuple[str, str, dict, object]] = []

    def request(self, method, url, headers=None, body=None, post_params=None,  # noqa: ANN001
                _request_timeout=None):  # noqa: ANN001 - the client's own signature
        self.requests.append((method, url, dict(headers or {}), body))
        name = url.rstrip("/").split("/")[-2]
        replicas = body["spec"]["replicas"] if isinstance(body, dict) else self.replicas
        data = json.dumps(scale_object(name, "serving", replicas)).encode()
        return k8s.rest.RESTResponse(SimpleNamespace(
            status=200, reason="OK", data=data,
            headers={"Content-Type": "application/json"}))


class Actors:
    """A deployment that records the workers it is told to start and end."""

    def __init__(self, prefill: int, decode: int) -> None:
        self.workers = {"prefill": prefill, "decode": decode}
        self.calls: list[str] = []
        self.metrics_address = "127.0.0.1:1"

    def addresses(self, role: str) -> list[str]:
        return [f"{role}-{i}" for i in range(self.workers[role])]

    def add_worker(self, role: str) -> str:
        self.calls.append(f"+{role}")
        self.workers[role] += 1
        return role

    def remove_worker(self, role: str) -> str:
        self.calls.append(f"-{role}")
        self.workers[role] -= 1
        return role


def test_the_ray_scaler_adds_before_it_removes() -> None:
    """A rebalance starts the new workers before any drains, so it never runs fewer."""
    actors = Actors(2, 2)
    scaler = RayScaler(actors)
    scaler.scale(1, 3)
    assert actors.calls == ["+decode", "-prefill"] and scaler.current() == (1, 3)
    actors.calls.clear()
    scaler.scale(3, 1)
    assert actors.calls == ["+prefill", "+prefill", "-decode", "-decode"]
    with pytest.raises(ValueError, match="at least one"):
        scaler.scale(0, 4)


def test_the_kubernetes_scaler_patches_the_scale_subresource() -> None:
    api_client = k8s.ApiClient(k8s.Configuration(host="https://cluster.invalid"))
    recorded = Recorded(replicas=2)
    api_client.rest_client = recorded
    scaler = KubernetesScaler("serving", "kvferry-prefill", "kvferry-decode",
                              api=k8s.AppsV1Api(api_client))
    assert scaler.current() == (2, 2)
    scaler.scale(3, 1)
    reads, patches = recorded.requests[:2], recorded.requests[2:]
    assert [(m, u) for m, u, _, _ in reads] == [
        ("GET", "https://cluster.invalid/apis/apps/v1/namespaces/serving/deployments/"
                "kvferry-prefill/scale"),
        ("GET", "https://cluster.invalid/apis/apps/v1/namespaces/serving/deployments/"
                "kvferry-decode/scale")]
    assert [(m, u.rsplit("/", 2)[-2], b) for m, u, _, b in patches] == [
        ("PATCH", "kvferry-prefill", {"spec": {"replicas": 3}}),
        ("PATCH", "kvferry-decode", {"spec": {"replicas": 1}})]
    for _, _, headers, _ in patches:  # a merge patch: fields given replace, nothing else moves
        assert headers["Content-Type"] == "application/merge-patch+json"
    # what the API would hold after each patch is a valid autoscaling/v1 Scale
    for name, replicas in (("kvferry-prefill", 3), ("kvferry-decode", 1)):
        kubernetes_validate.validate(scale_object(name, "serving", replicas), K8S_VERSION,
                                     strict=True)
    with pytest.raises(ValueError, match="replicas"):
        replicas_patch(-1)


@pytest.mark.parametrize("argv, says", [
    (["--profile", "P", "--sla", "ttft-p90=5"], "router_metrics"),
    (["--router-metrics", "http://x/metrics", "--profile", "P", "--sla", "ttft-p90=5"],
     "kubernetes_namespace"),
    (["--router-metrics-dns", "nohost", "--profile", "P", "--sla", "ttft-p90=5",
      "--dry-run", "--current", "1,1"], "HOST:PORT"),
    (["--router-metrics", "http://x/metrics", "--profile", "P", "--sla", "bad",
      "--dry-run", "--current", "1,1"], "sla"),
    (["--router-metrics", "http://x/metrics", "--profile", "P", "--sla", "ttft-p90=5",
      "--dry-run", "--current", "1,1", "--min-decode", "0"], "min_decode"),
])
def test_the_planner_command_says_what_is_wrong(tmp_path: Path, argv: list[str], says: str,
                                                capsys: pytest.CaptureFixture) -> None:
    profile = make_profile().save(tmp_path / "profile.json")
    argv = [str(profile) if a == "P" else a for a in argv]
    assert main(["planner", *argv]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1
