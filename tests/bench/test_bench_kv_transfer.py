"""bench/bench_kv_transfer.py: its arguments, the median and range of samples, the ratios to
memcpy, the NIXL target's verdict, the JSON rows, the NIXL descriptor count and the NIXL bare
ceiling's READ plan (all without servers), and one small NIXL run into a real decode worker
process (slow: about 40 s, 4 MiB pushes, no TTFT part)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.bench_kv_transfer import BYTES_PER_TOKEN, nixl_descriptors, parse_args, tokens_of
from bench.kv_transfer_nixl_bare import PoolShape, read_groups
from bench.kv_transfer_report import (
    SizeFigures,
    Spread,
    format_table,
    ratio_summary,
    target_verdict,
)
from kvferry.cache.budget import blocks_for_tokens
from kvferry.cache.layout import KvLayout
from kvferry.cache.pool import KvPool
from kvferry.transfer import wire
from kvferry.transfer.nixl.pages import PoolMemory
from kvferry.transfer.nixl.send import NIXL_MIN_GROUP_BYTES

REPO = Path(__file__).resolve().parents[2]


def test_defaults() -> None:
    args = parse_args([])
    assert args.transports == ["grpc", "nixl"] and args.reps == 3
    assert args.sizes_mib == [4, 64, 256]


@pytest.mark.parametrize("argv", [["--reps", "0"], ["--sizes-mib", "0"],
                                  ["--transports", "tcp"]])
def test_bad_input_exits_2(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2


def test_ratios_are_over_the_fastest_memcpy() -> None:
    size = SizeFigures(64, (8.0, 10.0, 9.0), {"nixl": (5.0, 3.0, 4.0)})
    assert Spread.of([5.0, 3.0, 4.0]) == Spread(4.0, 3.0, 5.0)
    assert size.memcpy_ref_gbps == 10.0
    assert size.ratio("nixl") == pytest.approx(Spread(0.4, 0.3, 0.5))
    row = size.to_json()
    assert row["nixl_ratio"] == pytest.approx(0.4) and row["nixl_ratio_min"] == pytest.approx(0.3)
    assert row["memcpy_gbps"] == 10.0 and row["memcpy_gbps_median"] == 9.0
    assert row["nixl_samples_gbps"] == [5.0, 3.0, 4.0]
    assert "nixl_descriptors_per_push" not in row


def test_target_needs_every_size_of_64_mib_and_more() -> None:
    small = SizeFigures(4, (10.0,), {"nixl": (1.0,)})  # below 64 MiB: not part of the target
    met = [small, SizeFigures(64, (10.0,), {"nixl": (4.0,)}),
           SizeFigures(256, (10.0,), {"nixl": (6.0,)})]
    verdict = target_verdict(met)
    assert verdict.is_met is True and verdict.ratios == pytest.approx({64: 0.4, 256: 0.6})
    assert "MET" in verdict.text
    missed = [*met[:2], SizeFigures(256, (10.0,), {"nixl": (6.0, 3.0, 3.9)})]
    assert target_verdict(missed).is_met is False
    assert target_verdict([small]).is_met is None  # no size big enough to tell
    assert target_verdict([SizeFigures(64, (10.0,), {"grpc": (1.0,)})]).is_met is None


def test_table_names_every_transport_and_the_descriptors() -> None:
    size = SizeFigures(4, (10.0,), {"grpc": (1.0,), "nixl": (5.0,), "nixl_bare": (8.0, 6.0)},
                       32)
    table = format_table([size], 1)
    assert "gRPC" in table and "NIXL" in table and "0.500x" in table
    nixl, bare = table.splitlines()[-2:]
    assert nixl.split()[-1] == "32"
    assert "NIXL bare" in bare and "0.700x [0.600-0.800]" in bare and "32" not in bare
    assert "NIXL bare/memcpy  4 MiB 0.700x" in ratio_summary([size])
    row = size.to_json()
    assert row["nixl_bare_gbps"] == 7.0 and row["nixl_bare_gbps_min"] == 6.0
    assert row["nixl_bare_ratio_max"] == pytest.approx(0.8)
    assert row["nixl_bare_samples_gbps"] == [8.0, 6.0]


def test_nixl_bare_reads_what_a_push_names() -> None:
    pool = KvPool(16, 8, 64, 16, blocks_for_tokens(tokens_of(4), 16) + 3, torch.float32)
    source = PoolShape.of(pool).make()
    local, remote = PoolMemory.of(pool), PoolMemory.of(source)
    groups = read_groups(local, remote, pool, tokens_of(4))
    spans = wire.plan_chunks(KvLayout.of_pool(pool, "x"), tokens_of(4), 1 << 62,
                             NIXL_MIN_GROUP_BYTES)
    assert len(groups) == len(spans) and source.cache.shape == pool.cache.shape
    assert sum(len(lo) for lo, _ in groups) == nixl_descriptors(pool, tokens_of(4), 1 << 62)
    assert sum(int(lo[:, 1].sum()) for lo, _ in groups) == 4 << 20
    for lo, re in groups:  # the same pages on both sides, each in its own pool
        assert (lo[:, 1] == re[:, 1]).all()
        assert ((lo[:, 0] - local.address) == (re[:, 0] - remote.address)).all()


def test_nixl_descriptors_one_per_layer_and_k_v_with_consecutive_blocks() -> None:
    pool = KvPool(16, 8, 64, 16, blocks_for_tokens(tokens_of(4), 16), torch.float32)
    assert tokens_of(4) * BYTES_PER_TOKEN == 4 << 20
    assert nixl_descriptors(pool, tokens_of(4), 1 << 62) == 16 * 2


@pytest.mark.slow
def test_small_nixl_run(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    result = subprocess.run(
        [sys.executable, "bench/bench_kv_transfer.py", "--sizes-mib", "4", "--reps", "1",
         "--transports", "nixl", "--ttft-prompt-tokens", "0",
         "--model-dir", str(tmp_path / "model"), "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "NIXL/memcpy" in result.stdout and "not checked" in result.stdout
    data = json.loads(out.read_text())
    row = data["rows"][0]
    assert row["mib"] == 4 and row["nixl_gbps"] > 0 and "grpc_gbps" not in row
    assert row["nixl_ratio"] == pytest.approx(row["nixl_gbps"] / row["memcpy_gbps"])
    assert row["nixl_descriptors_per_push"] == 32
    assert row["nixl_bare_gbps"] > 0 and "NIXL bare/memcpy" in result.stdout
    assert data["target"]["is_met"] is None  # 4 MiB only: the target covers 64 MiB and more
