"""The router works on its own records: the block size comes from the workers' layouts, and
the client adapters turn stats and decode updates into records faithfully."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from kvferry.cache.layout import KvLayout
from kvferry.cache.prefix import CacheEvent, EventsSince
from kvferry.cache.stats import PoolStats
from kvferry.errors import Unavailable
from kvferry.model.sampling import FinishReason
from kvferry.rpc import convert
from kvferry.v1 import worker_pb2
from router.downstream import Downstream
from router.policies.routing import HeadroomPolicy
from router.records import DecodeFinished, DecodeUpdate
from router.workers import decode_client
from router.workers.client import stats_from_reply
from router.workers.decode_client import _update_from_proto
from router.workers.registry import WorkerSet
from router.workers.worker import Worker


def _layout(block_size: int) -> KvLayout:
    return KvLayout(2, 2, 64, block_size, "bfloat16", "fp")


def _set(*workers: Worker) -> WorkerSet:
    return WorkerSet("fp", workers=list(workers))


def test_block_size_is_the_one_the_decode_workers_report() -> None:
    workers = _set(Worker("p", "prefill", None, layout=_layout(64), is_healthy=True),
                   Worker("d", "decode", None, layout=_layout(32), is_healthy=True))
    assert workers.block_size() == 32


def test_no_reported_layout_means_no_block_size_rather_than_a_guess() -> None:
    with pytest.raises(Unavailable, match="layout"):
        _set(Worker("d", "decode", None, is_healthy=True)).block_size()
    with pytest.raises(Unavailable, match="no healthy decode worker"):
        _set(Worker("d", "decode", None, layout=_layout(16))).block_size()


def test_admission_counts_blocks_of_the_reported_size() -> None:
    decode = Worker("d", "decode", None, layout=_layout(32), is_healthy=True, total_blocks=4)
    downstream = Downstream(_set(Worker("p", "prefill", None, is_healthy=True), decode),
                            HeadroomPolicy(), lease_s=30.0, admission_timeout_s=1.0)
    assert not downstream.admission_would_wait(100, 28)  # 128 tokens: 4 blocks of 32
    assert downstream.admission_would_wait(100, 29)  # 129 tokens: a fifth block


def test_stats_round_trip_through_the_proto() -> None:
    stats = PoolStats(total_blocks=10, free_blocks=4, reserved_blocks=3, num_running=2,
                      num_waiting=1, integrity_ok=False, integrity_error="bad",
                      num_preemptions=5, num_pending_prefill_tokens=6, num_decode_steps=7,
                      max_abort_delay_steps=8, projected_blocks=9, num_corrupt_pushes=11,
                      num_parked=12, num_evictions=13, num_compiles=14,
                      prefix_cache_queries=15, prefix_cache_hits=16, cached_blocks=17,
                      kv_evicted_blocks=18)
    msg = convert.stats_to_proto("decode", stats, convert.layout_to_proto(_layout(16)))
    events = EventsSince(20, [CacheEvent(19, [b"a" * 16], []), CacheEvent(20, [], [b"a" * 16])],
                         False)
    convert.add_cache_events(msg, events)
    pool, layout = stats_from_reply(msg)
    assert layout == _layout(16)
    assert pool.cache_events is not None
    assert pool.cache_events.seq == 20 and not pool.cache_events.is_snapshot
    assert [(e.stored, e.removed) for e in pool.cache_events.events] == [
        ([b"a" * 16], []), ([], [b"a" * 16])]
    assert dataclasses.replace(pool, cache_events=None) == stats


def test_decode_updates_become_records(monkeypatch: pytest.MonkeyPatch) -> None:
    finished = worker_pb2.DecodeUpdate(request_id="r", token_ids=[1, 2])
    finished.finished.reason = FinishReason.LENGTH.value
    finished.finished.first_decode_step_s = 0.5
    # Stamped with the monotonic clock when read off the stream (the adapter's only clock).
    monkeypatch.setattr(decode_client, "time", SimpleNamespace(monotonic=lambda: 123.5))
    assert _update_from_proto(finished) == DecodeUpdate(
        "r", [1, 2], DecodeFinished(FinishReason.LENGTH, 0.5), received_s=123.5)
    failed = worker_pb2.DecodeUpdate(request_id="r", error_code=8, error_message="full")
    assert _update_from_proto(failed)._replace(received_s=0.0) == DecodeUpdate(
        "r", [], None, 8, "full")
    assert _update_from_proto(worker_pb2.DecodeUpdate(request_id="r")).error_code is None
