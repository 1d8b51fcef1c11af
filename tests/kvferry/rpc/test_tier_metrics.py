"""A worker's per-tier statistics cross the proto intact and come out as labelled metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from kvferry.cache.prefix import Tier
from kvferry.cache.stats import PoolStats, TierStats
from kvferry.rpc import convert
from kvferry.rpc.metrics import WorkerCollector
from kvferry.v1 import worker_pb2

HOST = TierStats(Tier.HOST, capacity_blocks=10, used_blocks=3, hit_tokens=32, bytes_in=5,
                 bytes_out=7, evictions=1, dropped_writes=2, corrupt_blocks=0,
                 num_promotions=2, promotion_s=0.25)
DISK = TierStats(Tier.DISK, capacity_blocks=100, used_blocks=9, corrupt_blocks=4)


def _stats(*tiers: TierStats) -> PoolStats:
    return PoolStats(total_blocks=8, free_blocks=8, reserved_blocks=0, num_running=0,
                     num_waiting=0, integrity_ok=True, integrity_error="", tiers=tiers)


def test_tier_stats_survive_the_proto() -> None:
    msg = convert.stats_to_proto("decode", _stats(HOST, DISK), worker_pb2.KvLayout())
    assert [t.tier for t in msg.tiers] == [worker_pb2.KV_TIER_HOST, worker_pb2.KV_TIER_DISK]
    assert convert.stats_from_proto(msg).tiers == (HOST, DISK)


def _exposition(stats: PoolStats) -> dict[str, float]:
    registry = CollectorRegistry()
    registry.register(WorkerCollector("decode", lambda: stats, lambda: 0))
    lines = generate_latest(registry).decode().splitlines()
    return {name: float(value) for name, value in
            (line.rsplit(" ", 1) for line in lines if line and not line.startswith("#"))}


def test_each_tier_is_a_label_of_the_tier_metrics() -> None:
    samples = _exposition(_stats(HOST, DISK))
    assert samples['kvferry_external_prefix_cache_hits_total{tier="host"}'] == 32
    assert samples['kvferry_kv_tier_bytes_out_total{tier="host"}'] == 7
    assert samples['kvferry_kv_tier_blocks{tier="disk"}'] == 9
    assert samples['kvferry_kv_tier_corrupt_blocks_total{tier="disk"}'] == 4
    assert samples['kvferry_kv_tier_promotion_seconds_total{tier="host"}'] == 0.25
    assert not any("tier" in name for name in _exposition(_stats()))  # no tiers, no series
