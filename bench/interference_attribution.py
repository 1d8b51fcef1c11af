"""For bench/bench_interference.py --trace: where the slow token gaps of the short requests
went in the loaded phase, per deployment, over every repetition
(deploy/loadgen/attribution.py classifies each gap above 3x the run's median ITL)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from deploy.loadgen.attribution import UNEXPLAINED, attribute


def slow_gap_table(root: Path, names: list[str], repeats: int, rate: float
                   ) -> dict[str, dict[str, object]]:
    """Per deployment: slow gaps by cause, summed over the repetitions' trace folders
    `root/<name>-<n>`; prints one table per deployment."""
    out: dict[str, dict[str, object]] = {}
    for name in names:
        causes: Counter[str] = Counter()
        num_gaps = 0
        for repeat in range(1, repeats + 1):
            attr = attribute(root / f"{name}-{repeat}", phase=f"bench-{name}-loaded-{rate:g}",
                             tag="short")
            causes.update(row.cause for row in attr.rows)
            num_gaps += attr.num_gaps
        num_slow = sum(causes.values())
        explained = sum(n for cause, n in causes.items() if cause not in UNEXPLAINED)
        share = explained / num_slow if num_slow else 1.0
        print(f"{name}: slow gaps (> 3x the run's median ITL) of short requests, loaded, "
              f"{repeats} repetitions: {num_slow} of {num_gaps} gaps")
        for cause, n in causes.most_common():
            print(f"  {cause:<44} {n:>6}  {n / num_slow:6.1%}")
        print(f"  explained: {explained} of {num_slow} ({share:.1%})")
        out[name] = {"gaps": num_gaps, "slow_gaps": num_slow, "explained": explained,
                     "explained_share": share, "causes": dict(causes.most_common())}
    return out
