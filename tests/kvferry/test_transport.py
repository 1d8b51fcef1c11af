"""The gRPC K/V sender pipelines by layer: each layer group leaves as soon as the prefill
forward has written it, and never before."""

from __future__ import annotations

import asyncio

import torch

from kvferry import chunk_codec, wire
from kvferry.kv_pool import KvPool
from kvferry.transport import GrpcKvSender
from kvferry.v1 import worker_pb2


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
    pool = KvPool(num_layers=8, num_kv_heads=2, head_dim=8, block_size=4, num_blocks=16,
                  dtype=torch.float32)
    layout = wire.KvLayout.of_pool(pool, "fp")
    released = [0]
    log: list[tuple[int, int]] = []
    sender = GrpcKvSender()
    sender._push_kv = lambda address: _FakePushKv(released, log)  # type: ignore[method-assign]
    progress = asyncio.Event()

    async def ready(count: int) -> None:
        while released[0] < count:
            progress.clear()
            await progress.wait()

    async def forward() -> None:  # one layer at a time, like the prefill forward
        for layer in range(8):
            await asyncio.sleep(0.01)
            released[0] = layer + 1
            progress.set()

    async def scenario() -> None:
        push = asyncio.ensure_future(sender.push("x", "r", layout, 13, pool, [0, 1, 2, 3],
                                                 None, ready=ready))
        await forward()
        result = await push
        assert result.num_bytes == 8 * 4 * layout.bytes_per_layer_block

    asyncio.run(scenario())
    assert [end for end, _ in log] == [2, 4, 6, 8]  # 4 layer groups
    assert log[0][1] < 8  # the first group left while later layers were still computing
