"""bench/bench_kv_transfer.py: its arguments, the median and range of samples, the ratios to
memcpy, the NIXL target's verdict, the JSON rows and the NIXL descriptor count (all without
servers), and one small NIXL run into a real decode worker process (slow: about 40 s, 4 MiB
pushes, no TTFT part)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.bench_kv_transfer import BYTES_PER_TOKEN, nixl_descriptors, parse_args, tokens_of
from bench.kv_transfer_report import SizeFigures, Spread, format_table, target_verdict
from kvferry.cache.layout import blocks_for_tokens
from kvferry.cache.pool import KvPool

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
    table = format_table([SizeFigures(4, (10.0,), {"grpc": (1.0,), "nixl": (5.0,)}, 32)], 1)
    assert "gRPC" in table and "NIXL" in table and "0.500x" in table
    assert table.splitlines()[-1].split()[-1] == "32"


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
    assert data["target"]["is_met"] is None  # 4 MiB only: the target covers 64 MiB and more
