"""The router's view of its workers as Prometheus samples (`RouterWorkersCollector`), read off
a `WorkerSet` whose workers were put in known states the way the router puts them there: by
stats snapshots (applied, or refused as older), cache events, requests sent."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from kvferry.cache.prefix import CacheEvent, EventsSince
from kvferry.cache.stats import PoolStats
from kvferry.rpc.metrics import RouterWorkersCollector
from router.workers.registry import WorkerSet
from router.workers.worker import Worker

KEYS = [bytes([i]) * 16 for i in range(8)]


def _stats(num_running: int, total: int, projected: int,
           events: EventsSince | None = None) -> PoolStats:
    return PoolStats(total_blocks=total, free_blocks=total, reserved_blocks=0,
                     num_running=num_running, num_waiting=0, integrity_ok=True,
                     integrity_error="", projected_blocks=projected, cache_events=events)


def _workers() -> WorkerSet:
    decode = Worker("10.0.0.1:50061", "decode", None, is_healthy=True)
    decode.apply_stats(_stats(1, 64, 10, EventsSince(1, [CacheEvent(1, KEYS, [])], True)), 1.0)
    decode.apply_stats(_stats(3, 64, 30, EventsSince(2, [CacheEvent(2, [], KEYS[6:])], False)),
                       2.0)
    decode.apply_stats(_stats(9, 64, 90), 1.5)  # asked for before the last one: refused
    decode.add_in_flight("r1", 4, 0, KEYS + [b"predicted" * 2])  # predicted, not reported
    decode.add_in_flight("r2", 4, 0)
    prefill = Worker("10.0.0.2:50051", "prefill", None, is_healthy=False)  # never answered
    return WorkerSet("fp", workers=[decode, prefill])


def _sample(registry: CollectorRegistry, name: str, worker: str, role: str) -> float | None:
    return registry.get_sample_value(name, {"worker": worker, "role": role})


def test_the_collector_reports_what_the_router_believes() -> None:
    workers = _workers()
    registry = CollectorRegistry()
    registry.register(RouterWorkersCollector(lambda: workers.workers))
    decode, prefill = ("10.0.0.1:50061", "decode"), ("10.0.0.2:50051", "prefill")
    expected = {
        "kvferry_router_worker_healthy": (1, 0),
        "kvferry_router_worker_num_running": (3, 0),  # the newer snapshot's, not the refused
        "kvferry_router_worker_num_in_flight": (2, 0),
        "kvferry_router_worker_total_blocks": (64, 0),
        "kvferry_router_worker_projected_blocks": (30, 0),
        "kvferry_router_worker_cached_blocks": (6, 0),  # 8 stored, 2 evicted
        "kvferry_router_worker_stats_refreshes_total": (2, 0),
    }
    got = {name: (_sample(registry, name, *decode), _sample(registry, name, *prefill))
           for name in expected}
    assert got == expected


def test_the_collector_reads_the_workers_at_scrape_time() -> None:
    workers = _workers()
    registry = CollectorRegistry()
    registry.register(RouterWorkersCollector(lambda: workers.workers))
    decode = workers.workers[0]
    decode.is_healthy = False
    decode.forget_cache(3.0)
    decode.done("r1")
    added = Worker("10.0.0.3:50061", "decode", None)  # discovered after registration
    workers.workers.append(added)
    assert _sample(registry, "kvferry_router_worker_healthy", "10.0.0.1:50061", "decode") == 0
    assert _sample(registry, "kvferry_router_worker_cached_blocks", "10.0.0.1:50061",
                   "decode") == 0
    assert _sample(registry, "kvferry_router_worker_num_in_flight", "10.0.0.1:50061",
                   "decode") == 1
    assert _sample(registry, "kvferry_router_worker_stats_refreshes_total", added.address,
                   "decode") == 0
