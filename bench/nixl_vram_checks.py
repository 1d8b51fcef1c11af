"""NIXL between two processes' K/V pools in GPU memory (VRAM to VRAM), on a GPU machine:
the pages land intact, and how fast against a device-to-device copy of the same bytes.

A source process fills a pool (the geometry of bench/bench_kv_transfer.py: 16 layers, 8 K/V
heads, head_dim 64, block 16, fp32; 64 KiB per token) with seeded noise on the GPU and
registers it with a NIXL agent; this process READs into a pool of its own on the same GPU the
pages a push of each size names, one READ per group of at least 4 MiB, as the decode worker's
puller does (bench/kv_transfer_nixl_bare.py). After each size: the landed pages equal the
source's bit for bit, and the decode side's in-place checks (`nixl_pages.crc32_pages`,
`pages_finite`, which copy VRAM to the host) agree with the packed chunk's CRC-32C. Timed:
--reps sets of READs per size, and in the same run --reps device-to-device copies of the same
bytes in one process (torch `copy_`, synchronized). Figures are median [min-max].

Needs torch, a NIXL build for the machine's CUDA (`nixl`, `nixl-cu13` or `nixl-cu12`) and this
repository. Writes $OUT/nixl_vram_checks.json (OUT defaults to ./out); exits 1 when a check
fails. `--device cpu` runs the same on DRAM (a dry run on a machine without a GPU). Usage:

    python bench/nixl_vram_checks.py [--sizes-mib 4 64 256] [--reps 5] [--device cuda|cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "kernels"))
from bench.kv_transfer_nixl_bare import PoolShape, bare_nixl_gbps  # noqa: E402
from kvferry.cache.budget import blocks_for_tokens  # noqa: E402
from kvferry.cache.layout import KvLayout  # noqa: E402
from kvferry.cache.pool import KvPool  # noqa: E402
from kvferry.transfer import wire
from kvferry.transfer.nixl import pages as nixl_pages  # noqa: E402
from kvferry.transfer.nixl.send import NIXL_MIN_GROUP_BYTES  # noqa: E402

BYTES_PER_TOKEN = 2 * 16 * 8 * 64 * 4
SEED = 11


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_gbps(num_bytes: int, reps: int, device: torch.device) -> list[float]:
    """GB/s (bytes copied / time) of `reps` copies of `num_bytes` on `device`, after one."""
    src = torch.empty(num_bytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    rates = []
    for rep in range(reps + 1):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        if rep:
            rates.append(num_bytes / (time.perf_counter() - start) / 1e9)
    return rates


def check_landed(shape: PoolShape, checks: list[dict[str, Any]]):
    """After each size's READs: the sink's pages of the push against the source's."""
    expected = KvPool(*shape[:6])
    expected.cache.copy_(shape.seeded(SEED))

    def after(sink: KvPool, num_tokens: int) -> None:
        n = blocks_for_tokens(num_tokens, sink.block_size)
        table = list(range(n))
        landed = sink.cache[:, :, :n].cpu()
        equal = torch.equal(landed, expected.cache[:, :, :n])
        layout = KvLayout.of_pool(sink, "check")
        crc_ok, finite_ok = True, True
        for span in wire.plan_chunks(layout, num_tokens, 1 << 62, NIXL_MIN_GROUP_BYTES):
            packed = wire.pack_array(expected, table, span)  # what a gRPC push would carry
            crc_ok &= nixl_pages.crc32_pages(sink, table, span) == wire.crc32(packed)
            finite_ok &= nixl_pages.pages_finite(sink, table, span)
        checks.append({"tokens": num_tokens, "pages_equal": equal, "crc_matches": crc_ok,
                       "finite": finite_ok, "ok": equal and crc_ok and finite_ok})
        sink.cache.zero_()  # the next size must land again, not find these pages
    return after


def summary(samples: list[float]) -> dict[str, float]:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[4, 64, 256])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--device", default="cuda", help="cuda (VRAM) or cpu (DRAM dry run)")
    args = parser.parse_args()
    device = torch.device(args.device)
    tokens = [size * (1 << 20) // BYTES_PER_TOKEN for size in args.sizes_mib]
    pool = KvPool(16, 8, 64, 16, blocks_for_tokens(max(tokens), 16), torch.float32,
                  device=device)
    shape = PoolShape.of(pool)
    checks: list[dict[str, Any]] = []
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "memory_type": nixl_pages.PoolMemory.of(pool).memory_type,
        "torch": torch.__version__, "reps": args.reps, "checks": checks, "sizes": []}
    del pool
    try:
        nixl = bare_nixl_gbps(KvPool(*shape[:6], device=device), tokens, args.reps,
                              seed=SEED, after=check_landed(shape, checks))
    except Exception as exc:  # noqa: BLE001 - recorded: the run's point is to see it
        report["error"] = f"{type(exc).__name__}: {exc}"
        nixl = []
    for size, rates in zip(args.sizes_mib, nixl):
        copies = copy_gbps(size << 20, args.reps, device)
        row = {"size_mib": size, "nixl_gbps": summary(rates), "copy_gbps": summary(copies),
               "ratio_of_medians": statistics.median(rates) / statistics.median(copies),
               "ratio_to_fastest_copy": statistics.median(rates) / max(copies)}
        report["sizes"].append(row)
        print(f"{size:4d} MiB  NIXL {row['nixl_gbps']['median']:8.2f} GB/s "
              f"[{row['nixl_gbps']['min']:.2f}-{row['nixl_gbps']['max']:.2f}]  copy "
              f"{row['copy_gbps']['median']:8.2f} [{row['copy_gbps']['min']:.2f}-"
              f"{row['copy_gbps']['max']:.2f}]  NIXL/copy {row['ratio_of_medians']:.3f}")
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "nixl_vram_checks.json").write_text(json.dumps(report, indent=2))
    print(json.dumps({"checks": checks, "error": report.get("error")}))
    ok = not report.get("error") and checks and all(c["ok"] for c in checks)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
