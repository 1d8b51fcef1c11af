"""The figures of bench/bench_kv_transfer.py: GB/s samples summarised as median and range, the
ratios to memcpy, the printed table, the JSON rows, and the check of the NIXL target.

Every ratio is over the *fastest* memcpy of the same size in the same run (copies before and
after the transports): on a shared VM memory bandwidth drifts by 2x within minutes, and a
slow memcpy sample must not flatter a transport.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

# The acceptance target the benchmark makes checkable: "NIXL at or above 0.4x of memcpy for
# pushes of 64 MiB and more, cross-process, in the same run" (the median push of each size).
TARGET_TRANSPORT = "nixl"
TARGET_RATIO = 0.4
TARGET_MIN_MIB = 64

LABELS = {"grpc": "gRPC", "grpc_bare": "gRPC bare", "ray": "Ray", "nixl": "NIXL",
          "nixl_bare": "NIXL bare"}


class Spread(NamedTuple):
    """Median and range of samples."""

    median: float
    low: float
    high: float

    @classmethod
    def of(cls, samples: Sequence[float]) -> Spread:
        if not samples:
            raise ValueError("samples: none to summarise")
        return cls(statistics.median(samples), min(samples), max(samples))

    def over(self, base: float) -> Spread:
        return Spread(self.median / base, self.low / base, self.high / base)

    def text(self, digits: int = 3, unit: str = "") -> str:
        return (f"{self.median:.{digits}f}{unit} "
                f"[{self.low:.{digits}f}-{self.high:.{digits}f}]")


@dataclass(frozen=True)
class SizeFigures:
    """One push size's samples (GB/s), memcpy and each transport, from one run."""

    mib: int
    memcpy_gbps: tuple[float, ...]  # before and after the transports
    transport_gbps: dict[str, tuple[float, ...]] = field(default_factory=dict)
    nixl_descriptors: int | None = None  # per push, with consecutive blocks on both sides

    @property
    def memcpy_ref_gbps(self) -> float:
        """The denominator of every ratio: the fastest memcpy of this size."""
        return max(self.memcpy_gbps)

    def gbps(self, transport: str) -> Spread:
        return Spread.of(self.transport_gbps[transport])

    def ratio(self, transport: str) -> Spread:
        return self.gbps(transport).over(self.memcpy_ref_gbps)

    def to_json(self) -> dict[str, object]:
        copy = Spread.of(self.memcpy_gbps)
        row: dict[str, object] = {
            "mib": self.mib, "memcpy_gbps": self.memcpy_ref_gbps,
            "memcpy_gbps_median": copy.median, "memcpy_gbps_min": copy.low,
            "memcpy_samples_gbps": list(self.memcpy_gbps)}
        for name, samples in self.transport_gbps.items():
            gbps, ratio = self.gbps(name), self.ratio(name)
            row |= {f"{name}_gbps": gbps.median, f"{name}_gbps_min": gbps.low,
                    f"{name}_gbps_max": gbps.high, f"{name}_ratio": ratio.median,
                    f"{name}_ratio_min": ratio.low, f"{name}_ratio_max": ratio.high,
                    f"{name}_samples_gbps": list(samples)}
        if self.nixl_descriptors is not None:
            row["nixl_descriptors_per_push"] = self.nixl_descriptors
        return row


class Verdict(NamedTuple):
    """The NIXL target on one run: None when the run cannot tell (no NIXL, no size big
    enough)."""

    is_met: bool | None
    ratios: dict[int, float]  # MiB -> median NIXL / memcpy, the sizes the target covers
    text: str

    def to_json(self) -> dict[str, object]:
        return {"transport": TARGET_TRANSPORT, "min_ratio": TARGET_RATIO,
                "min_mib": TARGET_MIN_MIB, "is_met": self.is_met, "ratios": self.ratios,
                "text": self.text}


def target_verdict(figures: Sequence[SizeFigures]) -> Verdict:
    name = f"{LABELS[TARGET_TRANSPORT]} >= {TARGET_RATIO:.2f}x memcpy for pushes of " \
           f">= {TARGET_MIN_MIB} MiB (median, cross-process, same run)"
    ratios = {f.mib: f.ratio(TARGET_TRANSPORT).median for f in figures
              if f.mib >= TARGET_MIN_MIB and TARGET_TRANSPORT in f.transport_gbps}
    if not any(TARGET_TRANSPORT in f.transport_gbps for f in figures):
        return Verdict(None, {}, f"Target {name}: not checked, NIXL did not run")
    if not ratios:
        return Verdict(None, {}, f"Target {name}: not checked, no size of "
                                 f">= {TARGET_MIN_MIB} MiB in this run")
    is_met = all(r >= TARGET_RATIO for r in ratios.values())
    shown = ", ".join(f"{mib} MiB {r:.3f}x" for mib, r in ratios.items())
    return Verdict(is_met, ratios, f"Target {name}: {'MET' if is_met else 'MISSED'} ({shown})")


def format_table(figures: Sequence[SizeFigures], reps: int) -> str:
    """One line per size and transport: GB/s and ratio to memcpy, median [min-max]."""
    lines = [f"K/V push throughput, median [min-max] of {reps} timed pushes per size (after "
             "one untimed push);", "ratios over the fastest memcpy of the same size in this "
             "run.", f"{'MiB':>5}  {'transport':<10} {'GB/s median [min-max]':>26}  "
             f"{'x memcpy median [min-max]':>28}  {'NIXL descs':>10}"]
    for f in figures:
        lines.append(f"{f.mib:>5}  {'memcpy':<10} {Spread.of(f.memcpy_gbps).text():>26}  "
                     f"{f'(reference {f.memcpy_ref_gbps:.3f} GB/s)':>28}")
        for name in f.transport_gbps:
            descs = f.nixl_descriptors if name == "nixl" and f.nixl_descriptors else ""
            lines.append(f"{f.mib:>5}  {LABELS.get(name, name):<10} {f.gbps(name).text():>26}"
                         f"  {f.ratio(name).text(3, 'x'):>28}  {descs:>10}".rstrip())
    return "\n".join(lines)


def ratio_summary(figures: Sequence[SizeFigures]) -> str:
    """The ratios alone, one line per transport: what the targets are read from."""
    names = list(dict.fromkeys(n for f in figures for n in f.transport_gbps))
    return "\n".join(f"{LABELS.get(n, n) + '/memcpy':<17} " + "   ".join(
        f"{f.mib} MiB {f.ratio(n).median:.3f}x" for f in figures if n in f.transport_gbps)
        for n in names)
