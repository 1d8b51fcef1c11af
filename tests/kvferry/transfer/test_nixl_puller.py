"""The decode worker's NIXL end, in one process with two NIXL agents (UCX): groups are read
into the reservation and checked in place; a bad group is refused and zeroed; and a block
freed while a READ is writing into it goes back to the pool only once the READ is over."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Awaitable
from typing import Any

import pytest
import torch

from decode_worker.kv_receiver import KvReceiver
from decode_worker.receipt import KvReceipt
from decode_worker.sequence import DecodeSeq
from kvferry.cache.budget import blocks_for_tokens
from kvferry.cache.layout import KvLayout
from kvferry.cache.pool import KvPool
from kvferry.errors import DataLoss, InvalidArgument, NotFound, Unavailable
from kvferry.transfer import wire
from kvferry.transfer.nixl import pages as nixl_pages
from kvferry.transfer.nixl.receive import NixlPuller, Pull, PullOffer
from kvferry.transfer.nixl.send import NixlKvSender
from tests.waiting import DEADLINE_S, within

NUM_TOKENS = 45  # 3 blocks of 16


def _pool(seed: int | None) -> KvPool:
    pool = KvPool(num_layers=4, num_kv_heads=2, head_dim=8, block_size=16, num_blocks=16,
                  dtype=torch.float32)
    if seed is not None:
        pool.cache.copy_(torch.randn(pool.cache.shape,
                                     generator=torch.Generator().manual_seed(seed)))
    return pool


class HeldPuller(NixlPuller):
    """A puller whose READs wait, on its NIXL thread, until the test opens `release`: a READ
    the test knows is under way (`started`) for as long as it needs."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.started = threading.Event()
        self.release = threading.Event()

    def _read(self, pull: Pull, local: Any, remote: Any) -> None:
        self.started.set()
        if not self.release.wait(DEADLINE_S):
            raise Unavailable("the test never released the READ", "data")
        super()._read(pull, local, remote)


class Pair:
    """A prefill pool registered with one agent, a decode pool and its puller."""

    def __init__(self, puller: type[NixlPuller] = NixlPuller) -> None:
        self.src = _pool(seed=3)
        self.dst = _pool(seed=None)
        self.layout = KvLayout.of_pool(self.dst, "fp")
        self.sender = NixlKvSender()
        self.remote = self.sender.register(self.src)
        self.seqs: dict[str, DecodeSeq] = {}
        self.completed: list[str] = []
        self.receiver = KvReceiver(self.layout, self.dst, self.seqs,
                                   lambda seq: self.completed.append(seq.request_id))
        self.puller = puller(self.receiver)
        self.src_table = [9, 10, 2]
        self.seq = self.reserve("r1")

    def reserve(self, request_id: str) -> DecodeSeq:
        blocks = self.dst.allocator.alloc(blocks_for_tokens(NUM_TOKENS + 1, 16))
        seq = DecodeSeq(request_id, NUM_TOKENS, 4, blocks, time.monotonic() + 60,
                        KvReceipt(wire.coverage(self.layout, NUM_TOKENS)), arrival=0, lease_s=60)
        self.seqs[request_id] = seq
        return seq

    def begin_msg(self, **changes: object) -> PullOffer:
        offer = PullOffer("r1", self.layout, NUM_TOKENS, self.sender.agent.name,
                          self.sender.agent.get_agent_metadata(), self.remote,
                          list(self.src_table))
        return offer._replace(**changes)

    def group(self, span: wire.ChunkSpan, crc: int | None = None
              ) -> tuple[wire.ChunkSpan, Awaitable[int]]:
        """A group and its checksum, which comes a little after it (as on the stream)."""
        if crc is None:
            crc = nixl_pages.crc32_pages(self.src, self.src_table, span)
        return span, asyncio.ensure_future(_later(crc))

    def dst_pages(self, span: wire.ChunkSpan) -> torch.Tensor:
        return torch.from_numpy(wire.pack_array(self.dst, self.seq.block_table, span).copy())

    def src_pages(self, span: wire.ChunkSpan) -> torch.Tensor:
        return torch.from_numpy(wire.pack_array(self.src, self.src_table, span).copy())

    def close(self) -> None:
        self.puller.close()


async def _later(value: int) -> int:
    await asyncio.sleep(0.01)  # paces: the checksum comes after its group, as on the stream
    return value


@pytest.fixture
def pair():
    made = Pair()
    yield made
    made.close()


SPANS = wire.plan_chunks(KvLayout(4, 2, 8, 16, "float32", "fp"), NUM_TOKENS, 1 << 40)


def test_groups_are_read_into_the_reservation(pair: Pair) -> None:
    async def run() -> int:
        pull = await pair.puller.begin(pair.begin_msg())
        written = 0
        for span in SPANS:
            written += await pair.puller.group(pull, *pair.group(span))
        pair.receiver.finish_push("r1", pull.epoch)
        return written

    written = asyncio.run(run())
    whole = wire.ChunkSpan(0, 4, 0, 3)
    assert torch.equal(pair.dst_pages(whole), pair.src_pages(whole))
    assert written == pair.layout.bytes_per_layer_block * 4 * 3
    assert pair.completed == ["r1"] and pair.seq.receipt.is_complete
    assert pair.puller.num_fenced_blocks == 0
    assert pair.dst.allocator.check_integrity().ok


def test_a_checksum_mismatch_is_refused(pair: Pair) -> None:
    span = SPANS[0]

    async def run() -> None:
        pull = await pair.puller.begin(pair.begin_msg())
        await pair.puller.group(pull, *pair.group(span, crc=123))

    with pytest.raises(InvalidArgument) as exc:
        asyncio.run(run())
    assert exc.value.field == "crc32"
    assert not pair.seq.receipt.received.any()  # nothing counts as delivered: the push is resent
    assert pair.puller.num_fenced_blocks == 0


def test_non_finite_pages_are_refused_and_zeroed(pair: Pair) -> None:
    span = SPANS[1]
    pair.src.cache[span.layer_start, 1, pair.src_table[0], 0, 0, 0] = float("inf")

    async def run() -> None:
        pull = await pair.puller.begin(pair.begin_msg())
        await pair.puller.group(pull, *pair.group(span))

    with pytest.raises(DataLoss):
        asyncio.run(run())
    assert not pair.dst_pages(span).any()


def test_blocks_freed_mid_read_wait_for_the_read() -> None:
    """The reservation is released (abort, lease expiry) while a READ writes into its blocks:
    they stay out of the pool until the READ is over, then come back; the group fails."""
    pair = Pair(HeldPuller)
    puller = pair.puller
    assert isinstance(puller, HeldPuller)
    try:
        allocator = pair.dst.allocator
        blocks = list(pair.seq.block_table)
        span = SPANS[0]

        async def run() -> None:
            pull = await pair.puller.begin(pair.begin_msg())
            reading = asyncio.create_task(pair.puller.group(pull, *pair.group(span)))
            assert await asyncio.to_thread(puller.started.wait, DEADLINE_S), "no READ started"
            del pair.seqs["r1"]
            allocator.free(blocks)  # what abort and lease expiry do
            fenced = blocks[:span.num_blocks]
            assert pair.puller.num_fenced_blocks == span.num_blocks
            assert allocator.num_free == allocator.num_blocks - span.num_blocks
            taken = allocator.alloc(allocator.num_free)  # everything the pool will give
            assert not set(taken) & set(fenced)
            allocator.free(taken)
            assert allocator.check_integrity().ok
            puller.release.set()
            with pytest.raises(NotFound):
                await within(reading, "the group")
            # The fence drops on the loop once the READ and its check are over.
            await within(pair.puller.settled("r1"), "the READ's fence dropped")
            assert pair.puller.num_fenced_blocks == 0
            assert allocator.num_free == allocator.num_blocks

        asyncio.run(run())
        assert allocator.check_integrity().ok
    finally:
        puller.release.set()
        pair.close()


def test_a_stream_cancelled_mid_read_keeps_the_fence_until_the_read_ends() -> None:
    pair = Pair(HeldPuller)
    puller = pair.puller
    assert isinstance(puller, HeldPuller)
    try:
        span = SPANS[0]

        async def run() -> None:
            pull = await pair.puller.begin(pair.begin_msg())
            reading = asyncio.create_task(pair.puller.group(pull, *pair.group(span)))
            assert await asyncio.to_thread(puller.started.wait, DEADLINE_S), "no READ started"
            reading.cancel()  # the prefill worker's stream broke
            with pytest.raises(asyncio.CancelledError):
                await reading
            assert pair.puller.num_fenced_blocks == span.num_blocks  # READ still running
            puller.release.set()
            await within(pair.puller.settled("r1"), "the READ's fence dropped")
            assert pair.puller.num_fenced_blocks == 0

        asyncio.run(run())
        pair.dst.allocator.free(pair.seq.block_table)
        assert pair.dst.allocator.num_free == pair.dst.allocator.num_blocks
    finally:
        puller.release.set()
        pair.close()


def test_a_begin_that_does_not_fit_is_refused_naming_the_field(pair: Pair) -> None:
    cases = [
        ("block_table", dict(block_table=[1, 2])),
        ("num_tokens", dict(num_tokens=44 - 16)),
        ("memory_type", dict(remote=pair.remote._replace(memory_type="DISK"))),
        ("agent_metadata", dict(agent_name="someone-else")),
        ("agent_metadata", dict(agent_name="garbled", agent_metadata=b"not metadata")),
        ("layout", dict(layout=dataclasses.replace(pair.layout, block_size=32))),
    ]
    for field, change in cases:
        with pytest.raises(InvalidArgument) as exc:
            asyncio.run(pair.puller.begin(pair.begin_msg(**change)))
        assert exc.value.field == field, field
    with pytest.raises(InvalidArgument, match="outside"):
        asyncio.run(pair.puller.begin(pair.begin_msg(block_table=[99, 1, 2])))
