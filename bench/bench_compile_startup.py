"""Worker start-up with the decode step compiled, in one run.

Each repetition starts a colocated deployment (one worker and the router) of `--model` three
ways, and times `Deployment.start`, from the first spawn to every process ready (the worker
reports SERVING only after its decode step is built, kvferry.model.compiled):
  cold:  `--compile MODE` with an empty compile cache (a new KVFERRY_COMPILE_CACHE): every
         bucket exported, compiled ahead of time and written as a package;
  warm:  the same, started again on that cache: every bucket's package loaded;
  eager: `--compile off`, for what start-up costs without compiling.
The worker's own log says how many buckets came from the cache; a warm start that compiled
anything is reported as a failure. Target: warm start-up under 60 s. Median [min-max] over
--repeats. Usage:

    .venv/bin/python bench/bench_compile_startup.py [--model default] [--mode default]
        [--buckets 8,32] [--repeats 3] [--kinds cold,warm,eager] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script too
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "kernels"))
from deploy.default_model import BENCH_MODEL_HELP, bench_model  # noqa: E402
from deploy.launcher import Deployment  # noqa: E402
from kvferry.settings import COMPILE_MODES, parse_batch_sizes  # noqa: E402

TARGET_WARM_S = 60.0
KINDS = ("cold", "warm", "eager")
_HITS = re.compile(r"decode step compiled for batch sizes \S+ in [\d.]+ s \((\d+) of (\d+) "
                   r"from the cache\)")


def start_once(model: str, mode: str, buckets: str, cache_dir: Path, log_dir: Path
               ) -> tuple[float, tuple[int, int] | None]:
    """Seconds to start a colocated deployment, and (packages loaded, buckets) from the
    worker's log (None for an eager worker)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    deployment = Deployment(model=model, num_prefill=0, num_decode=1, is_colocated=True,
                            compile=mode, compile_batch_sizes=buckets, log_dir=log_dir,
                            env={"KVFERRY_COMPILE_CACHE": str(cache_dir)})
    start = time.perf_counter()
    with deployment:
        elapsed = time.perf_counter() - start
    if mode == "off":
        return elapsed, None
    logs = "\n".join(p.read_text() for p in log_dir.glob("colocated-*.log"))
    found = _HITS.findall(logs)
    if not found:
        raise RuntimeError(f"no compile summary in the worker's log ({log_dir})")
    hits, total = found[-1]
    return elapsed, (int(hits), int(total))


def span(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} [{min(values):.1f}-{max(values):.1f}]"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help=BENCH_MODEL_HELP)
    p.add_argument("--mode", default="default", choices=COMPILE_MODES[1:])
    p.add_argument("--buckets", default="8,32", help="--compile-batch-sizes")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kinds", default="cold,warm,eager",
                   help="which starts to time, in this order (warm needs cold before it)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    kinds = args.kinds.split(",")
    if not kinds or set(kinds) - set(KINDS) or len(set(kinds)) < len(kinds) or (
            "warm" in kinds and "cold" not in kinds[:kinds.index("warm")]):
        p.error(f"--kinds: distinct names from {','.join(KINDS)}, cold before warm; "
                f"got {args.kinds!r}")
    try:
        parse_batch_sizes(args.buckets)
    except ValueError as exc:
        p.error(f"--buckets: {exc}")
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    model = str(bench_model(args.model))
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    failures: list[str] = []
    with tempfile.TemporaryDirectory(prefix="bench_compile_startup-") as tmp:
        root = Path(tmp)
        for r in range(args.repeats):
            cache = root / f"cache-{r}"
            for kind in kinds:
                mode = "off" if kind == "eager" else args.mode
                elapsed, hits = start_once(model, mode, args.buckets, cache,
                                           root / f"logs-{r}-{kind}")
                times[kind].append(elapsed)
                expected = {"cold": 0, "warm": len(parse_batch_sizes(args.buckets))}.get(kind)
                if hits is not None and hits[0] != expected:
                    failures.append(f"repetition {r + 1} {kind}: {hits[0]} of {hits[1]} "
                                    f"buckets from the cache, expected {expected}")
                print(f"repetition {r + 1}/{args.repeats} {kind}: {elapsed:.1f} s"
                      + (f" ({hits[0]} of {hits[1]} from the cache)" if hits else ""),
                      flush=True)
            shutil.rmtree(cache, ignore_errors=True)  # a package per bucket, model-sized
    warm = statistics.median(times["warm"]) if "warm" in times else float("nan")
    print(f"\n{args.model}, --compile {args.mode}, buckets {args.buckets}; "
          f"{args.repeats} repetitions, median [min-max] seconds to ready")
    for kind, values in times.items():
        print(f"  {kind:>5}: {span(values)}")
    is_met = warm < TARGET_WARM_S and not failures
    print(f"warm start-up {warm:.1f} s, target < {TARGET_WARM_S:.0f} s: "
          f"{'met' if is_met else 'NOT met'}")
    for failure in failures:
        print(f"  {failure}")
    if args.out:
        args.out.write_text(json.dumps({
            "model": args.model, "mode": args.mode, "buckets": args.buckets,
            "repeats": args.repeats, "seconds": times, "failures": failures,
            "target_warm_s": TARGET_WARM_S, "is_met": is_met}, indent=1) + "\n")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
