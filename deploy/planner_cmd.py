"""`kvferry planner`: the live planner as a process of its own (deploy/planner/loop.py),
scaling the prefill and decode Deployments of a Kubernetes namespace (k8s/overlays/planner)
to the SLA, or, with --dry-run, only saying what it would do."""

from __future__ import annotations

import argparse
import sys
import time

from deploy.planner_args import build_planner, planner_args


def add_planner_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("planner", help="scale prefill and decode workers to an SLA, live")
    p.add_argument("--router-metrics", action="append", default=[], metavar="URL",
                   help="a router's Prometheus endpoint (its --metrics-port), "
                        "http://HOST:PORT/metrics; once per router")
    p.add_argument("--router-metrics-dns", default=None, metavar="HOST:PORT",
                   help="instead: every address HOST resolves to (a headless Service), "
                        "each interval")
    planner_args(p)
    p.add_argument("--kubernetes-namespace", default=None,
                   help="scale the Deployments of this namespace (in-cluster credentials); "
                        "in-cluster: the planner pod's own")
    p.add_argument("--prefill-deployment", default="kvferry-prefill",
                   help="the prefill workers' Deployment (default: %(default)s)")
    p.add_argument("--decode-deployment", default="kvferry-decode",
                   help="the decode workers' Deployment (default: %(default)s)")
    p.add_argument("--dry-run", action="store_true",
                   help="decide and log, scale nothing (needs --kubernetes-namespace or "
                        "--current P,D to know what runs)")
    p.add_argument("--current", default=None, metavar="P,D",
                   help="with --dry-run and no namespace: the prefill and decode workers "
                        "running")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve the planner's own metrics (kvferry_planner_*) here")
    p.add_argument("--host", default="127.0.0.1",
                   help="address the metrics port binds (default: %(default)s, as every "
                        "kvferry server; 0.0.0.0 in a pod)")


class _Fixed:
    """--dry-run without a cluster: what runs is what --current says."""

    def __init__(self, text: str) -> None:
        try:
            prefill, decode = (int(v) for v in text.split(","))
        except ValueError:
            raise ValueError(f"current: expected P,D, got {text!r}") from None
        self.counts = (prefill, decode)

    def current(self) -> tuple[int, int]:
        return self.counts

    def scale(self, num_prefill: int, num_decode: int) -> None:
        self.counts = (num_prefill, num_decode)


def build_loop(args: argparse.Namespace):
    """The loop the flags describe; ValueError naming a bad flag."""
    from prometheus_client import REGISTRY

    from deploy.planner.loop import PlannerLoop, PlannerMetrics
    from deploy.planner.observe import dns_urls, scraper
    from deploy.planner.scalers import KubernetesScaler

    if bool(args.router_metrics) == bool(args.router_metrics_dns):
        raise ValueError("router_metrics: give --router-metrics URL or --router-metrics-dns")
    urls = (dns_urls(args.router_metrics_dns) if args.router_metrics_dns
            else lambda: list(args.router_metrics))
    if args.kubernetes_namespace is None and not (args.dry_run and args.current):
        raise ValueError("kubernetes_namespace: needed to scale (or --dry-run --current P,D)")
    planner = build_planner(args)
    scaler = (_Fixed(args.current) if args.kubernetes_namespace is None else
              KubernetesScaler(args.kubernetes_namespace, args.prefill_deployment,
                               args.decode_deployment))
    return PlannerLoop(planner, scraper(urls, time.monotonic), scaler,
                       PlannerMetrics(REGISTRY), args.dry_run)


def run_planner(args: argparse.Namespace) -> int:
    try:
        loop = build_loop(args)
    except (ValueError, OSError) as exc:
        print(f"kvferry: planner: {exc}", file=sys.stderr)
        return 2
    if args.metrics_port is not None:
        from prometheus_client import start_http_server

        start_http_server(args.metrics_port, addr=args.host)
    while True:
        try:
            loop.run_once()
        except Exception as exc:  # noqa: BLE001 - the router or the API unreachable for a
            # moment, a conflict on a patch: said, and tried again next interval
            print(f"kvferry: planner: {type(exc).__name__}: {exc}", file=sys.stderr)
        time.sleep(args.interval_s)
