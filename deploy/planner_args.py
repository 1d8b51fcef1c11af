"""The live planner's policy flags: `kvferry planner`'s, and serve's with the prefix
"planner-" (a Ray deployment scaled from its own driver)."""

from __future__ import annotations

import argparse
from pathlib import Path


def planner_args(p: argparse.ArgumentParser, prefix: str = "") -> None:
    """What the planner plans from and its guards: `kvferry planner`'s flags, and serve's
    with prefix "planner-" (a Ray deployment scaled from its own driver)."""
    required = not prefix  # serve runs no planner unless asked
    p.add_argument(f"--{prefix}profile", type=Path, required=required, default=None,
                   help="what `kvferry profile` measured")
    p.add_argument(f"--{prefix}sla", required=required, default=None,
                   metavar="ttft-p90=MS,itl-p90=MS", help="latency targets, as plan --sla")
    p.add_argument(f"--{prefix}interval-s", type=float, default=30.0, help="between decisions")
    p.add_argument(f"--{prefix}patience", type=int, default=2,
                   help="intervals a new target must hold before anything moves")
    p.add_argument(f"--{prefix}headroom", type=float, default=1.2,
                   help="a smaller layout must meet the SLA at this times the observed rate")
    for role in ("prefill", "decode"):
        p.add_argument(f"--{prefix}min-{role}", type=int, default=1,
                       help=f"{role} workers, at least")
        p.add_argument(f"--{prefix}max-{role}", type=int, default=8,
                       help=f"{role} workers, at most")
    p.add_argument(f"--{prefix}max-workers", type=int, default=8,
                   help="prefill + decode, at most")
    p.add_argument(f"--{prefix}latency-correction", type=float, default=0.5,
                   help="weight of each interval's measured/predicted latency in the "
                        "correction applied to the profile's predictions (0: trust the "
                        "profile as it is)")


def build_planner(args: argparse.Namespace, prefix: str = ""):
    """The planner `planner_args`' flags describe; ValueError naming a bad flag."""
    from deploy.planner.live import Bounds, Planner
    from deploy.planner.profile import CostModel, Profile
    from deploy.planner.search import Sla

    def flag(name: str):
        return getattr(args, (prefix + name).replace("-", "_"))

    if not flag("interval-s") > 0 or flag("patience") < 1 or not flag("headroom") >= 1:
        raise ValueError(f"{prefix}interval_s must be > 0, {prefix}patience >= 1 and "
                         f"{prefix}headroom >= 1".replace("-", "_"))
    if not 0 <= flag("latency-correction") <= 1:
        raise ValueError(f"{prefix}latency_correction: must be in [0, 1]".replace("-", "_"))
    bounds = Bounds(flag("min-prefill"), flag("max-prefill"), flag("min-decode"),
                    flag("max-decode"), flag("max-workers"))
    budget = None  # serve's --kv-eviction, which the simulator counts as the workers do
    if getattr(args, "kv_eviction", None) is not None:
        from deploy.eviction_args import eviction_config
        from kvferry.cache.budget import KvBudget

        budget = KvBudget(eviction_config(args))
    return Planner(CostModel(Profile.load(flag("profile")), kv_budget=budget),
                   Sla.parse(flag("sla")), bounds,
                   flag("patience"), flag("headroom"), flag("latency-correction"))
