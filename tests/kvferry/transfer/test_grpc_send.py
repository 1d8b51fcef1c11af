"""The gRPC K/V sender pipelines by layer: each layer group leaves as soon as the prefill
forward has written it, and never before; it sends a push again when grpc.aio lost the
push's status, and only then."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from kvferry.cache.layout import KvLayout
from kvferry.cache.pool import KvPool
from kvferry.errors import Internal, Remote
from kvferry.transfer import wire
from kvferry.transfer.grpc import chunk_codec
from kvferry.transfer.grpc import send as grpc_push
from kvferry.transfer.grpc.send import GrpcKvSender
from kvferry.v1 import worker_pb2
from tests.waiting import within


class _FakePushKv:
    def __init__(self, released: list[int], log: list[tuple[int, int]]) -> None:
        self.released, self.log = released, log

    async def __call__(self, chunks, timeout=None):
        async for raw in chunks:
            chunk = chunk_codec.decode(raw)
            assert chunk.layer_end <= self.released[0], "sent before its layers were written"
            self.log.append((chunk.layer_end, self.released[0]))
        return worker_pb2.PushKvResponse()


def test_layer_groups_leave_as_soon_as_written() -> None:
    """The forward writes one layer at a time and computes the next only once the sender has
    sent all it could and waits for a layer not yet written: each group must have left by
    then, with exactly its own layers written."""
    pool = KvPool(num_layers=8, num_kv_heads=2, head_dim=8, block_size=4, num_blocks=16,
                  dtype=torch.float32)
    layout = KvLayout.of_pool(pool, "fp")
    released = [0]
    log: list[tuple[int, int]] = []
    sender = GrpcKvSender()
    sender._push_kv = lambda address: _FakePushKv(released, log)  # type: ignore[method-assign]
    progress = asyncio.Event()
    waiting = asyncio.Event()  # the sender waits for a layer the forward has not written

    async def ready(count: int) -> None:
        while released[0] < count:
            progress.clear()
            waiting.set()
            await progress.wait()

    async def forward() -> None:  # one layer at a time, like the prefill forward
        for layer in range(8):
            await within(waiting.wait(), f"the sender waiting for layer {layer + 1}")
            waiting.clear()
            released[0] = layer + 1
            progress.set()

    async def scenario() -> None:
        push = asyncio.ensure_future(sender.push("x", "r", layout, 13, pool, [0, 1, 2, 3],
                                                 None, ready=ready))
        await forward()
        result = await within(push, "the push")
        assert result.num_bytes == 8 * 4 * layout.bytes_per_layer_block

    asyncio.run(scenario())
    # 4 layer groups, each sent when its last layer was written and before the next one was
    assert log == [(2, 2), (4, 4), (6, 6), (8, 8)]


class _RefusingPushKv:
    """Answers each push with the next status in `codes` (None: accepted)."""

    def __init__(self, answers: list[tuple[grpc.StatusCode, str] | None]) -> None:
        self.answers = answers
        self.num_calls = 0

        self.corrupt_calls: list[bool] = []  # per push: did a chunk fail its checksum

    async def __call__(self, chunks, timeout=None):
        corrupt = False
        async for raw in chunks:
            chunk = chunk_codec.decode(raw)
            corrupt |= wire.crc32(chunk.data) != chunk.crc32
        self.corrupt_calls.append(corrupt)
        self.num_calls += 1
        answer = self.answers.pop(0)
        if answer is None:
            return worker_pb2.PushKvResponse()
        code, details = answer
        raise grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def _push(answers: list[tuple[grpc.StatusCode, str] | None],
          sender: GrpcKvSender | None = None,
          fake: _RefusingPushKv | None = None) -> tuple[GrpcKvSender, int]:
    pool = KvPool(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, num_blocks=4,
                  dtype=torch.float32)
    pool.cache.normal_()
    layout = KvLayout.of_pool(pool, "fp")
    sender = sender or GrpcKvSender()
    fake = fake or _RefusingPushKv(answers)
    sender._push_kv = lambda address: fake  # type: ignore[method-assign]
    asyncio.run(sender.push("x", "r", layout, 5, pool, [0, 1], None))
    return sender, fake.num_calls


LOST = (grpc.StatusCode.INTERNAL, grpc_push.LOST_STATUS_DETAILS)


def test_a_push_whose_status_grpc_lost_is_sent_again() -> None:
    sender, num_calls = _push([LOST, LOST, None])
    assert num_calls == 3 and sender.num_lost_statuses == 2


def test_a_lost_status_behind_already_exists_ends_as_delivered() -> None:
    sender, num_calls = _push([LOST, (grpc.StatusCode.ALREADY_EXISTS, "K/V complete")])
    assert num_calls == 2 and sender.num_lost_statuses == 1


def test_lost_statuses_are_resent_a_bounded_number_of_times() -> None:
    with pytest.raises(Internal) as exc:
        _push([LOST] * (grpc_push.MAX_LOST_STATUS_RESENDS + 1))
    assert exc.value.downstream and exc.value.remote_code == grpc.StatusCode.INTERNAL.value[0]


def test_a_real_internal_error_is_not_resent() -> None:
    with pytest.raises(Internal) as exc:
        _push([(grpc.StatusCode.INTERNAL, "request r: boom"), None])
    assert str(exc.value) == "request r: boom" and exc.value.downstream


def test_a_push_resent_after_a_lost_status_goes_again_as_it_was() -> None:
    """Fault injection included: the corrupted push whose refusal grpc.aio lost is resent
    corrupted, so with no resends left for corruption it fails with DATA_LOSS."""
    fake = _RefusingPushKv([LOST, (grpc.StatusCode.INVALID_ARGUMENT, "crc32: mismatch")])
    with pytest.raises(Remote) as exc:
        _push([], GrpcKvSender(max_resends=0, corrupt_pushes=1), fake)
    assert exc.value.code == grpc.StatusCode.DATA_LOSS.value[0]
    assert fake.corrupt_calls == [True, True]
