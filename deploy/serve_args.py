"""The router and process flags `serve` and `demo` pass on (docs/cli.md promises
them for every process): the routing policy and its weights, the drain timeout, the public
ports' client certificates and the router's plaintext health port; and where the processes
run and how much memory the workers take (deploy/placement.py)."""

from __future__ import annotations

import argparse

from deploy.policy_args import policy_args
from kvferry.settings import (
    CPU_POOL_BYTES,
    CUDA_UTILIZATION,
    DEFAULT_DRAIN_TIMEOUT_S,
    DEPLOYMENT_TORCH_THREADS,
)

MEMORY_HELP = (f"with --kv-pool-size auto: the share of the device the workers use, weights, "
               f"activations and pool together (default {CUDA_UTILIZATION} of a GPU; on CPU "
               f"none: {CPU_POOL_BYTES >> 20}MiB pools); serve divides it among the workers "
               "sharing a device")


def placement_args(p: argparse.ArgumentParser, prefix: str = "", pin_note: str = "") -> None:
    """--torch-threads and --pin-cores of a deployment serve starts (bench's launched ones:
    `prefix` "launch: ", and `pin_note` what differs there)."""
    p.add_argument("--torch-threads", type=int, default=0,
                   help=f"{prefix}per worker process (0: one per core it is placed on; "
                        f"{DEPLOYMENT_TORCH_THREADS} when not placed)")
    p.add_argument("--pin-cores", default="auto", choices=("auto", "off"),
                   help=f"{prefix}auto: each worker on cores (and GPUs) of its own where the "
                        "machine has enough, the router on what is left; off: the kernel "
                        f"places them{pin_note}")
    p.add_argument("--lend-cores", default="auto", choices=("auto", "off"),
                   help=f"{prefix}auto: with --pin-cores auto on CPU, a prefill and a decode "
                        "worker each also run a thread on the other's cores while the other "
                        "has nothing to compute; off: each its own cores only")


def serve_process_args(p: argparse.ArgumentParser) -> None:
    policy_args(p)
    placement_args(p)
    p.add_argument("--memory-utilization", type=float, default=None, help=MEMORY_HELP)
    p.add_argument("--drain-timeout-s", type=float, default=DEFAULT_DRAIN_TIMEOUT_S,
                   help="every process, on SIGTERM: report NOT_SERVING, refuse new requests "
                        "and let in-flight ones finish for up to this long, then exit")
    p.add_argument("--public-client-auth", action="store_true",
                   help="the router's public ports (gRPC and HTTP) also require client "
                        "certificates signed by --tls-ca")
    p.add_argument("--health-port", type=int, default=None,
                   help="the router also serves grpc.health.v1 alone, in plaintext, on this "
                        "port (probes that cannot speak TLS)")


def serve_process_argv(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """(the router's flags, every worker's) from the flags above."""
    router = ["--policy", args.policy, "--prefix-weight", str(args.prefix_weight),
              "--prefill-prefix-weight", str(args.prefill_prefix_weight),
              "--load-weight", str(args.load_weight), "--demand-weight", str(args.demand_weight),
              "--local-prefill-threshold", str(args.local_prefill_threshold)]
    drain = ["--drain-timeout-s", str(args.drain_timeout_s)]
    if args.public_client_auth:
        router.append("--public-client-auth")
    if args.health_port is not None:
        router += ["--health-port", str(args.health_port)]
    return router + drain, drain
