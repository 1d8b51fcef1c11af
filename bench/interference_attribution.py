"""For bench/bench_interference.py --trace: where the slow token gaps of the short requests
went in the loaded phase, per deployment, over every repetition
(deploy/loadgen/attribution.py classifies each gap above 3x the run's median ITL).

Run alone, it reads a trace folder again (the report is a function of the traces) and
rewrites the attribution of the benchmark's JSON:

    python bench/interference_attribution.py TRACE_DIR bench/results/bench_interference.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "kernels"))
from deploy.loadgen.attribution import UNEXPLAINED, attribute  # noqa: E402
from deploy.loadgen.causes import family_of  # noqa: E402


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
        families: Counter[str] = Counter()
        for cause, n in causes.items():
            families[family_of(cause)] += n
        print("  by family (a gap several families share counts under its largest):")
        for family, n in families.most_common():
            print(f"    {family:<42} {n:>6}  {n / num_slow:6.1%}")
        out[name] = {"gaps": num_gaps, "slow_gaps": num_slow, "explained": explained,
                     "explained_share": share, "causes": dict(causes.most_common()),
                     "families": dict(families.most_common())}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace_dir", type=Path, help="bench_interference.py --trace DIR")
    parser.add_argument("result", type=Path, help="the run's JSON (bench_interference*.json)")
    args = parser.parse_args()
    payload = json.loads(args.result.read_text())
    names = list(payload["runs"])
    repeats = len(payload["runs"][names[0]])
    payload["summary"]["attribution"] = slow_gap_table(args.trace_dir, names, repeats,
                                                       float(payload["args"]["rate"]))
    args.result.write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
