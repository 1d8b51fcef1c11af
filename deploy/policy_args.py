"""The router's worker-choice flags (`--policy` and the prefix policy's cost weights,
router/policies/routing.py), and the settings fields they fill: one place for `deploy.args`."""

from __future__ import annotations

import argparse
from typing import Any

from kvferry.settings import (
    DEFAULT_DEMAND_WEIGHT,
    DEFAULT_LOAD_WEIGHT,
    DEFAULT_PREFILL_PREFIX_WEIGHT,
    DEFAULT_PREFIX_WEIGHT,
    POLICIES,
)


def policy_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policy", default=POLICIES[0], choices=POLICIES,
                   help="prefix: cached blocks and load, in blocks (router/policies/routing.py); "
                        "priced: the same in seconds, each cache tier priced by what the "
                        "workers measure (router/policies/priced.py); headroom, round_robin, "
                        "least_requests: no cache")
    p.add_argument("--prefix-weight", type=float, default=DEFAULT_PREFIX_WEIGHT,
                   help="prefix policy: cost of each prompt block not cached on a decode "
                        "worker (a block pushed there)")
    p.add_argument("--prefill-prefix-weight", type=float,
                   default=DEFAULT_PREFILL_PREFIX_WEIGHT,
                   help="prefix policy: cost of each prompt block not cached on a prefill "
                        "worker (a block computed there)")
    p.add_argument("--load-weight", type=float, default=DEFAULT_LOAD_WEIGHT,
                   help="prefix policy: cost of each block of load on a worker (K/V blocks "
                        "in use on decode, pending prompt tokens per block on prefill)")
    p.add_argument("--demand-weight", type=float, default=DEFAULT_DEMAND_WEIGHT,
                   help="prefix policy: cost of each block of recent demand on a decode "
                        "worker (blocks of the requests sent there, decaying over "
                        "seconds): where a new conversation starts")
    p.add_argument("--local-prefill-threshold", type=int, default=0,
                   help="prompts under this many tokens prefill on the decode worker; 0: off")


def policy_settings(args: argparse.Namespace) -> dict[str, Any]:
    """RouterSettings fields from the flags of `policy_args`."""
    return dict(policy=args.policy, prefix_weight=args.prefix_weight,
                prefill_prefix_weight=args.prefill_prefix_weight,
                load_weight=args.load_weight, demand_weight=args.demand_weight,
                local_prefill_threshold=args.local_prefill_threshold)
