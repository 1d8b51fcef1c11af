"""The decode worker validates every K/V chunk against its layout and the reservation before
writing, and frees reservations whose K/V never arrives (lease)."""

from __future__ import annotations

import asyncio

import crc32c
import grpc
import numpy as np
import pytest
import torch

from deploy.launcher import Deployment
from kvferry.cache.pool import KvPool
from kvferry.rpc.convert import layout_from_proto
from kvferry.rpc.grpc_util import CHANNEL_OPTIONS
from kvferry.transfer.grpc.send import GrpcKvSender
from kvferry.v1 import generation_pb2, worker_pb2, worker_pb2_grpc
from tests.conftest import assert_alive, assert_pools_clean

pytestmark = pytest.mark.slow


def _stubs(deployment: Deployment):
    chan = grpc.insecure_channel(deployment.addresses("decode")[0], options=CHANNEL_OPTIONS)
    return chan, worker_pb2_grpc.DecodeServiceStub(chan), worker_pb2_grpc.KvTransferServiceStub(
        chan)


def _chunk(stats: worker_pb2.WorkerStats, request_id: str, num_tokens: int,
           **overrides: object) -> worker_pb2.KvChunk:
    layout = worker_pb2.KvLayout()
    layout.CopyFrom(stats.layout)
    lay = stats.layout
    element = 4  # float32 pool
    size = lay.num_layers * 2 * 1 * lay.block_size * lay.num_kv_heads * lay.head_dim * element
    data = np.arange(size // element, dtype=np.float32).tobytes()  # finite: NaN is refused
    fields = dict(request_id=request_id, layout=layout, num_tokens=num_tokens, layer_start=0,
                  layer_end=lay.num_layers, block_start=0, num_blocks=1, data=data,
                  crc32=crc32c.crc32c(data))
    fields.update(overrides)
    return worker_pb2.KvChunk(**fields)


def _bad_layout(stats: worker_pb2.WorkerStats, **changes: object) -> worker_pb2.KvLayout:
    layout = worker_pb2.KvLayout()
    layout.CopyFrom(stats.layout)
    for name, value in changes.items():
        setattr(layout, name, value)
    return layout


BAD_CHUNKS = {
    "block_size": lambda s: {"layout": _bad_layout(s, block_size=32)},
    "dtype": lambda s: {"layout": _bad_layout(s, dtype="bfloat16")},
    "model_fingerprint": lambda s: {"layout": _bad_layout(s, model_fingerprint="other")},
    "crc32": lambda s: {"crc32": 12345},
    "num_tokens": lambda s: {"num_tokens": 9},
    "block_start": lambda s: {"block_start": 1},
    "layer_start": lambda s: {"layer_end": s.layout.num_layers + 1},
    "data": lambda s: {"data": b"\0" * 10, "crc32": crc32c.crc32c(b"\0" * 10)},
}


@pytest.mark.parametrize("field", sorted(BAD_CHUNKS))
def test_bad_chunk_is_refused_before_any_write(field: str, qwen3_deployment: Deployment) -> None:
    chan, decode, kv = _stubs(qwen3_deployment)
    with chan:
        stats = decode.GetStats(worker_pb2.GetStatsRequest(), timeout=10)
        request_id = f"bad-{field}"
        decode.Reserve(worker_pb2.ReserveRequest(request_id=request_id, num_prompt_tokens=5,
                                                 max_tokens=4, lease_s=30), timeout=10)
        overrides = BAD_CHUNKS[field](stats)
        chunk = _chunk(stats, request_id, overrides.pop("num_tokens", 5), **overrides)
        with pytest.raises(grpc.RpcError) as exc:
            kv.PushKv(iter([chunk]), timeout=10)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in exc.value.details()
        # A correct push still goes through after a refused one.
        kv.PushKv(iter([_chunk(stats, request_id, 5)]), timeout=10)
        decode.Abort(generation_pb2.AbortRequest(request_id=request_id), timeout=10)
    assert_pools_clean(qwen3_deployment)
    assert_alive(qwen3_deployment)


def test_push_without_reservation_is_not_found(qwen3_deployment: Deployment) -> None:
    chan, decode, kv = _stubs(qwen3_deployment)
    with chan:
        stats = decode.GetStats(worker_pb2.GetStatsRequest(), timeout=10)
        with pytest.raises(grpc.RpcError) as exc:
            kv.PushKv(iter([_chunk(stats, "nobody", 5)]), timeout=10)
        assert exc.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as exc:
            decode.Abort(generation_pb2.AbortRequest(request_id="nobody"), timeout=10)
        assert exc.value.code() == grpc.StatusCode.NOT_FOUND
    assert_pools_clean(qwen3_deployment)


def test_reservation_without_kv_expires_with_its_lease(qwen3_deployment: Deployment) -> None:
    chan, decode, _ = _stubs(qwen3_deployment)
    with chan:
        # A long lease first, so that checking the reservation cannot race its expiry.
        reply = decode.Reserve(worker_pb2.ReserveRequest(
            request_id="orphan", num_prompt_tokens=40, max_tokens=40, lease_s=60), timeout=10)
        try:
            assert reply.num_blocks == 3  # prompt + the first decode slot; the rest grows
            stats = decode.GetStats(worker_pb2.GetStatsRequest(), timeout=10)
            assert stats.reserved_blocks == 3 and stats.num_waiting == 1
        finally:  # from now on nothing renews it: the lease runs out in 0.5 s
            renewed = decode.RenewLeases(worker_pb2.RenewLeasesRequest(
                request_ids=["orphan"], lease_s=0.5), timeout=10)
        assert list(renewed.unknown_ids) == []
        # Polled until the expiry freed it (nothing else would; 60 s only bounds a hang).
        assert_pools_clean(qwen3_deployment, timeout_s=60)
        gone = decode.RenewLeases(worker_pb2.RenewLeasesRequest(
            request_ids=["orphan"], lease_s=0.5), timeout=10)
        assert list(gone.unknown_ids) == ["orphan"]


async def _push_again(deployment: Deployment, stats: worker_pb2.WorkerStats, request_id: str,
                      times: int) -> list[int]:
    """Bytes each of `times` GrpcKvSender pushes of a 5-token prompt delivered."""
    layout = layout_from_proto(stats.layout)
    pool = KvPool(layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.block_size,
                  1, torch.float32)
    sender = GrpcKvSender()
    try:
        return [(await sender.push(deployment.addresses("decode")[0], request_id, layout, 5,
                                   pool, [0], timeout_s=10)).num_bytes for _ in range(times)]
    finally:
        await sender.close()


def test_second_push_of_complete_kv_is_already_exists(qwen3_deployment: Deployment) -> None:
    """A push to a reservation whose K/V is complete (a prefill worker lost just after its
    push ended, so the router prefilled again) answers ALREADY_EXISTS and writes nothing;
    GrpcKvSender takes that as delivered."""
    chan, decode, kv = _stubs(qwen3_deployment)
    with chan:
        stats = decode.GetStats(worker_pb2.GetStatsRequest(), timeout=10)
        decode.Reserve(worker_pb2.ReserveRequest(request_id="twice", num_prompt_tokens=5,
                                                 max_tokens=8, lease_s=30), timeout=10)
        try:
            first = kv.PushKv(iter([_chunk(stats, "twice", 5)]), timeout=10)
            assert first.bytes_written > 0
            with pytest.raises(grpc.RpcError) as exc:
                kv.PushKv(iter([_chunk(stats, "twice", 5)]), timeout=10)
            assert exc.value.code() == grpc.StatusCode.ALREADY_EXISTS
            # The decode worker refuses each of these after its first chunk, while the sender
            # is still writing: grpc.aio sometimes loses that status (transport.
            # LOST_STATUS_DETAILS), so a single push would seldom show it.
            assert asyncio.run(_push_again(qwen3_deployment, stats, "twice", 200)) == [0] * 200
        finally:  # a failure here must not leave blocks held for the next test
            decode.Abort(generation_pb2.AbortRequest(request_id="twice"), timeout=10)
    assert_pools_clean(qwen3_deployment)
