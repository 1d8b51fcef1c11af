"""Hostile K/V pushes against an in-process decode engine: every malformed or malicious chunk
is refused before any write, with the status and field its case expects, so no byte of the
pool changes, and in particular no other request's blocks. The cases over a real gRPC
server live in test_kv_push.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import grpc
import pytest
import torch

from decode_worker.engine import DecodeEngine
from decode_worker.sequence import FinishedEvent, TokensEvent
from kvferry.cache.budget import blocks_for_tokens
from kvferry.cache.layout import KvLayout
from kvferry.cache.pool import KvPool
from kvferry.errors import Aborted, DataLoss, InvalidArgument
from kvferry.model.config import load_model_config
from kvferry.model.sampling import SamplingParams
from kvferry.model.transformer import Transformer
from kvferry.rpc import convert
from kvferry.transfer import wire
from kvferry.transfer.grpc.receive import PushKvReceiver
from kvferry.transfer.ray.receive import RayKvReceiver
from kvferry.v1 import worker_pb2
from kvferry_kernels import kv_quant
from kvferry_kernels.dispatch import get_attention_backend
from tests.waiting import within

BLOCK_SIZE = 4
PROMPT = 10  # tokens: 3 blocks of 4
MAX_TOKENS = 4


class Push:
    """A sender's view of one request: its own pool filled with random K/V, and the chunks a
    correct push would send."""

    def __init__(self, layout: KvLayout, num_tokens: int, seed: int) -> None:
        self.layout = layout
        self.num_tokens = num_tokens
        num_blocks = blocks_for_tokens(num_tokens, layout.block_size)
        self.pool = KvPool(layout.num_layers, layout.num_kv_heads, layout.head_dim,
                           layout.block_size, num_blocks, torch.float32, torch.device("cpu"))
        gen = torch.Generator().manual_seed(seed)
        self.pool.cache.copy_(torch.randn(self.pool.cache.shape, generator=gen))
        self.block_table = list(range(num_blocks))

    def chunk(self, span: wire.ChunkSpan) -> tuple[wire.ChunkSpan, bytes, int]:
        data = wire.pack_array(self.pool, self.block_table, span).tobytes()
        return span, data, wire.crc32(data)

    def whole(self) -> wire.ChunkSpan:
        blocks = blocks_for_tokens(self.num_tokens, self.layout.block_size)
        return wire.ChunkSpan(0, self.layout.num_layers, 0, blocks)


@pytest.fixture
def engine(qwen3_checkpoint: Path) -> Iterator[DecodeEngine]:
    config = load_model_config(qwen3_checkpoint)
    model = Transformer(config, get_attention_backend("torch"), torch.float32,
                        torch.device("cpu"))
    pool = KvPool(config.num_layers, config.num_kv_heads, config.head_dim, BLOCK_SIZE, 32,
                  torch.float32, torch.device("cpu"))
    engine = DecodeEngine(model, pool, KvLayout.of_pool(pool, config.fingerprint))
    yield engine
    engine.steps.executor.shutdown(wait=True)


def _reserve(engine: DecodeEngine, request_id: str, num_tokens: int = PROMPT) -> None:
    asyncio.run(engine.reserve(request_id, num_tokens, MAX_TOKENS, 30.0))


def _victim(engine: DecodeEngine) -> Push:
    """Request B, reserved and holding its complete K/V."""
    _reserve(engine, "B")
    push = Push(engine.layout, PROMPT, seed=1)
    engine.receiver.receive_chunk("B", engine.layout, PROMPT, *push.chunk(push.whole()))
    engine.receiver.finish_push("B")
    return push


def _victim_pages(engine: DecodeEngine) -> torch.Tensor:
    table = engine._seqs["B"].block_table[:blocks_for_tokens(PROMPT, BLOCK_SIZE)]
    return engine.pool.cache[:, :, table].clone()


def _wrong_layout(layout: KvLayout, **changes: object) -> KvLayout:
    fields = {name: getattr(layout, name) for name in layout.__dataclass_fields__}
    return KvLayout(**{**fields, **changes})


# Each case: (chunk's request id, layout, num_tokens, span, data, crc32) from the engine's
# layout and A's honest push.
Case = Callable[[KvLayout, Push], tuple[str, KvLayout, int, wire.ChunkSpan, bytes, int]]


def _sized(layout: KvLayout, span: wire.ChunkSpan) -> tuple[wire.ChunkSpan, bytes, int]:
    """A span with a payload of exactly the size it claims (so only the span is wrong)."""
    size = (span.layer_end - span.layer_start) * span.num_blocks * layout.bytes_per_layer_block
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    return span, data, wire.crc32(data)


def _with_nan(push: Push, value: float = float("nan")) -> tuple[wire.ChunkSpan, bytes, int]:
    """An honest chunk with one value replaced, checksummed after: only the content is bad."""
    span, data, _ = push.chunk(push.whole())
    values = torch.frombuffer(bytearray(data), dtype=torch.float32)
    values[len(values) // 2] = value
    raw = values.numpy().tobytes()
    return span, raw, wire.crc32(raw)


class Hostile(NamedTuple):
    """A hostile chunk, and the status and message start PushKv refuses it with (the field
    it names first)."""

    make: Case
    code: grpc.StatusCode
    names: str


INVALID, DATA_LOSS = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DATA_LOSS

HOSTILE: dict[str, Hostile] = {
    "more blocks than reserved": Hostile(lambda lay, a: (
        "A", lay, PROMPT, *_sized(lay, wire.ChunkSpan(0, lay.num_layers, 0, 4))),
        INVALID, "block_start"),
    "block range past the reservation": Hostile(lambda lay, a: (
        "A", lay, PROMPT, *_sized(lay, wire.ChunkSpan(0, 1, 2, 2))), INVALID, "block_start"),
    "negative block_start": Hostile(lambda lay, a: (
        "A", lay, PROMPT, *_sized(lay, wire.ChunkSpan(0, 1, -1, 1))), INVALID, "block_start"),
    "zero blocks": Hostile(lambda lay, a: (
        "A", lay, PROMPT, *_sized(lay, wire.ChunkSpan(0, 1, 0, 0))), INVALID, "block_start"),
    "layers past the model": Hostile(lambda lay, a: (
        "A", lay, PROMPT, *_sized(lay, wire.ChunkSpan(0, lay.num_layers + 1, 0, 1))),
        INVALID, "layer_start"),
    "empty layer range": Hostile(lambda lay, a: (
        "A", lay, PROMPT, *_sized(lay, wire.ChunkSpan(1, 1, 0, 1))), INVALID, "layer_start"),
    "num_tokens above the reservation": Hostile(lambda lay, a: (
        "A", lay, PROMPT + 8, *_sized(lay, wire.ChunkSpan(0, lay.num_layers, 0, 5))),
        INVALID, "num_tokens"),
    "num_tokens below the reservation": Hostile(lambda lay, a: (
        "A", lay, 4, *a.chunk(wire.ChunkSpan(0, lay.num_layers, 0, 1))), INVALID, "num_tokens"),
    "dtype": Hostile(lambda lay, a: (
        "A", _wrong_layout(lay, dtype="bfloat16"), PROMPT, *a.chunk(a.whole())),
        INVALID, "layout.dtype"),
    "num_kv_heads": Hostile(lambda lay, a: (
        "A", _wrong_layout(lay, num_kv_heads=lay.num_kv_heads * 2), PROMPT,
        *a.chunk(a.whole())), INVALID, "layout.num_kv_heads"),
    "head_dim": Hostile(lambda lay, a: (
        "A", _wrong_layout(lay, head_dim=lay.head_dim // 2), PROMPT, *a.chunk(a.whole())),
        INVALID, "layout.head_dim"),
    "block_size": Hostile(lambda lay, a: (
        "A", _wrong_layout(lay, block_size=BLOCK_SIZE * 2), PROMPT, *a.chunk(a.whole())),
        INVALID, "layout.block_size"),
    "payload longer than the span": Hostile(lambda lay, a: (
        "A", lay, PROMPT, a.whole(), a.chunk(a.whole())[1] + b"\0" * 64,
        wire.crc32(a.chunk(a.whole())[1] + b"\0" * 64)), INVALID, "data"),
    "payload shorter than the span": Hostile(lambda lay, a: (
        "A", lay, PROMPT, a.whole(), a.chunk(a.whole())[1][:-64],
        wire.crc32(a.chunk(a.whole())[1][:-64])), INVALID, "data"),
    # INVALID_ARGUMENT naming crc32, not DATA_LOSS: the sender resends a push refused so
    # (kvferry/transfer/grpc/send.py _is_corruption), as bytes corrupted in flight.
    "checksum": Hostile(lambda lay, a: ("A", lay, PROMPT, a.whole(), a.chunk(a.whole())[1], 1),
                        INVALID, "crc32"),
    "NaN in the K/V, checksum right": Hostile(lambda lay, a: ("A", lay, PROMPT, *_with_nan(a)),
                                              DATA_LOSS, "data"),
    "inf in the K/V, checksum right": Hostile(lambda lay, a: (
        "A", lay, PROMPT, *_with_nan(a, float("inf"))), DATA_LOSS, "data"),
    "victim's complete K/V": Hostile(lambda lay, a: ("B", lay, PROMPT, *a.chunk(a.whole())),
                                     grpc.StatusCode.ALREADY_EXISTS, "request_id"),
    "unknown request": Hostile(lambda lay, a: ("C", lay, PROMPT, *a.chunk(a.whole())),
                               grpc.StatusCode.NOT_FOUND, "request_id"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_chunk_changes_no_byte(name: str, engine: DecodeEngine) -> None:
    """Through PushKv, the decode worker's gRPC edge: each hostile chunk is refused with its
    own status, the message starting with the field it names."""
    victim = _victim(engine)
    _reserve(engine, "A")
    attacker = Push(engine.layout, PROMPT, seed=2)
    before = engine.pool.cache.clone()
    hostile = HOSTILE[name]
    request_id, layout, num_tokens, span, data, crc = hostile.make(engine.layout, attacker)
    with pytest.raises(_Aborted) as exc:
        _push_kv(engine, [_to_proto(request_id, layout, num_tokens, (span, data, crc))])
    assert exc.value.code == hostile.code, str(exc.value)
    assert str(exc.value).startswith(hostile.names), str(exc.value)
    assert torch.equal(engine.pool.cache, before), "a refused chunk wrote to the pool"
    # B still holds exactly what its own push delivered.
    expected = victim.pool.cache
    assert torch.equal(_victim_pages(engine), expected)
    # A's honest push still goes through afterwards.
    engine.receiver.receive_chunk("A", engine.layout, PROMPT, *attacker.chunk(attacker.whole()))
    engine.receiver.finish_push("A")


def test_duplicate_and_overlapping_chunks_are_refused(engine: DecodeEngine) -> None:
    victim = _victim(engine)
    _reserve(engine, "A")
    attacker = Push(engine.layout, PROMPT, seed=2)
    first = wire.ChunkSpan(0, 1, 0, 2)
    engine.receiver.receive_chunk("A", engine.layout, PROMPT, *attacker.chunk(first))
    written = engine.pool.cache.clone()
    for span in (first, wire.ChunkSpan(0, 1, 1, 2), wire.ChunkSpan(0, 2, 0, 1)):
        with pytest.raises(InvalidArgument, match="overlaps"):
            engine.receiver.receive_chunk("A", engine.layout, PROMPT, *attacker.chunk(span))
        assert torch.equal(engine.pool.cache, written)
    assert torch.equal(_victim_pages(engine), victim.pool.cache)


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code


class _Context:
    """Just enough of grpc.aio.ServicerContext for PushKv: abort raises."""

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise _Aborted(code, details)


def _to_proto(request_id: str, layout: KvLayout, num_tokens: int,
              chunk: tuple[wire.ChunkSpan, bytes, int]) -> worker_pb2.KvChunk:
    span, data, crc = chunk
    return worker_pb2.KvChunk(
        request_id=request_id, layout=convert.layout_to_proto(layout), num_tokens=num_tokens,
        layer_start=span.layer_start, layer_end=span.layer_end, block_start=span.block_start,
        num_blocks=span.num_blocks, data=data, crc32=crc)


def _push_kv(engine: DecodeEngine, chunks: list[worker_pb2.KvChunk]) -> None:
    """One PushKv stream of `chunks` into the decode worker's servicer."""
    async def push() -> None:
        async def stream() -> AsyncIterator[worker_pb2.KvChunk]:
            for chunk in chunks:
                yield chunk
        await PushKvReceiver(engine.receiver).PushKv(stream(), _Context())

    asyncio.run(push())


def test_push_switching_to_another_request_is_refused(engine: DecodeEngine) -> None:
    """A push for A that names B halfway: refused at the switch, nothing of it reaches B,
    and A's partial pages are forgotten (A may be pushed again)."""
    _reserve(engine, "B")
    _reserve(engine, "A")
    attacker = Push(engine.layout, PROMPT, seed=2)
    b_before = _victim_pages(engine)
    half = engine.layout.num_layers // 2
    chunks = [_to_proto("A", engine.layout, PROMPT, attacker.chunk(wire.ChunkSpan(0, half, 0, 3))),
              _to_proto("B", engine.layout, PROMPT,
                        attacker.chunk(wire.ChunkSpan(half, engine.layout.num_layers, 0, 3)))]

    with pytest.raises(_Aborted) as exc:
        _push_kv(engine, chunks)
    assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "request_id" in str(exc.value)
    assert torch.equal(_victim_pages(engine), b_before)
    assert not engine._seqs["B"].receipt.received.any()
    assert not engine._seqs["A"].receipt.received.any()
    engine.receiver.receive_chunk("A", engine.layout, PROMPT, *attacker.chunk(attacker.whole()))
    engine.receiver.finish_push("A")



def test_nan_push_is_data_loss_and_others_decode_unchanged(engine: DecodeEngine) -> None:
    """Through PushKv: a push holding NaN ends with DATA_LOSS naming the data, nothing of it
    is written, and the victim's decode gives the same tokens as on an engine that never saw
    the hostile push."""
    def victim_tokens(eng: DecodeEngine) -> list[int]:
        async def run() -> list[int]:
            eng.start()
            try:
                events = eng.attach("B", 7, SamplingParams(temperature=0.0), MAX_TOKENS - 1, [])
                tokens: list[int] = []
                while True:
                    event = await within(events.get(), "B's next update")
                    if isinstance(event, TokensEvent):
                        tokens += event.token_ids
                    else:
                        assert isinstance(event, FinishedEvent), event
                        return tokens
            finally:
                await eng.stop()
        return asyncio.run(run())

    _victim(engine)
    _reserve(engine, "A")
    before = engine.pool.cache.clone()

    with pytest.raises(_Aborted) as exc:
        _push_kv(engine, [_to_proto("A", engine.layout, PROMPT,
                                    _with_nan(Push(engine.layout, PROMPT, seed=2)))])
    assert exc.value.code == grpc.StatusCode.DATA_LOSS
    assert "data" in str(exc.value) and "non-finite" in str(exc.value)
    assert torch.equal(engine.pool.cache, before)
    got = victim_tokens(engine)
    clean = DecodeEngine(engine.model, KvPool(
        engine.pool.num_layers, engine.pool.num_kv_heads, engine.pool.head_dim, BLOCK_SIZE, 32,
        torch.float32, torch.device("cpu")), engine.layout)
    _victim(clean)
    assert got == victim_tokens(clean) and len(got) == MAX_TOKENS - 1


def test_a_newer_push_supersedes_an_unfinished_one(engine: DecodeEngine) -> None:
    """A prefill worker went silent mid-push and another one pushes the same prompt again:
    the new push takes the reservation over; the old one's late chunks are refused and its
    failure does not wipe the new pages."""
    _reserve(engine, "A")
    old, new = Push(engine.layout, PROMPT, seed=2), Push(engine.layout, PROMPT, seed=3)
    half = wire.ChunkSpan(0, 1, 0, blocks_for_tokens(PROMPT, BLOCK_SIZE))
    first = engine.receiver.begin_push("A")
    engine.receiver.receive_chunk("A", engine.layout, PROMPT, *old.chunk(half), first)
    second = engine.receiver.begin_push("A")
    engine.receiver.receive_chunk("A", engine.layout, PROMPT, *new.chunk(new.whole()), second)
    with pytest.raises(Aborted, match="superseded"):
        engine.receiver.receive_chunk("A", engine.layout, PROMPT, *old.chunk(half), first)
    engine.receiver.fail_push("A", first)  # the stale stream ends: no effect on the new push
    engine.receiver.finish_push("A", second)
    table = engine._seqs["A"].block_table[:blocks_for_tokens(PROMPT, BLOCK_SIZE)]
    assert torch.equal(engine.pool.cache[:, :, table],
                       new.pool.cache[:, :, new.block_table])


def test_a_superseded_ray_push_is_refused(engine: DecodeEngine) -> None:
    """The Ray receiver fences pushes with the same epochs as gRPC: once a second push has
    begun, the first one's chunks and finish are refused with ABORTED and its failure does
    not wipe the new pages."""
    receiver = RayKvReceiver(engine.receiver)
    _reserve(engine, "A")
    old, new = Push(engine.layout, PROMPT, seed=2), Push(engine.layout, PROMPT, seed=3)
    half = wire.ChunkSpan(0, 1, 0, blocks_for_tokens(PROMPT, BLOCK_SIZE))
    first = receiver.begin("A").epoch
    assert first is not None
    assert not receiver.push_chunk("A", engine.layout, PROMPT, *old.chunk(half), first).error_code
    second = receiver.begin("A").epoch
    assert second is not None and second != first
    ack = receiver.push_chunk("A", engine.layout, PROMPT, *old.chunk(half), first)
    assert ack.error_code == grpc.StatusCode.ABORTED.value[0]
    assert "superseded" in ack.error_message
    assert receiver.finish("A", first).error_code == grpc.StatusCode.ABORTED.value[0]
    receiver.fail("A", first)  # the stale push ends: no effect on the new one
    assert not receiver.push_chunk("A", engine.layout, PROMPT, *new.chunk(new.whole()),
                                   second).error_code
    assert not receiver.finish("A", second).error_code
    table = engine._seqs["A"].block_table[:blocks_for_tokens(PROMPT, BLOCK_SIZE)]
    assert torch.equal(engine.pool.cache[:, :, table],
                       new.pool.cache[:, :, new.block_table])


def test_a_ray_push_to_an_actor_that_does_not_decode_is_refused() -> None:
    begun = RayKvReceiver(None).begin("A")
    assert begun.epoch is None
    assert begun.refusal.error_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
def test_a_quantized_chunk_whose_scale_dequantizes_to_inf_is_data_loss(
        kv_dtype: str, qwen3_checkpoint: Path) -> None:
    """A finite scale past `kv_quant.max_scale` passes an isfinite check but reads back as
    inf: refused with DATA_LOSS like inf itself, nothing written. The
    honest chunk it was made from is accepted."""
    config = load_model_config(qwen3_checkpoint)
    model = Transformer(config, get_attention_backend("torch"), torch.float32,
                        torch.device("cpu"))

    def quant_pool(num_blocks: int) -> KvPool:
        return KvPool(config.num_layers, config.num_kv_heads, config.head_dim, BLOCK_SIZE,
                      num_blocks, torch.float32, torch.device("cpu"), kv_cache_dtype=kv_dtype)

    pool = quant_pool(32)
    engine = DecodeEngine(model, pool, KvLayout.of_pool(pool, config.fingerprint))
    try:
        sender = quant_pool(blocks_for_tokens(PROMPT, BLOCK_SIZE))
        g = torch.Generator().manual_seed(5)
        for layer in range(config.num_layers):
            for pages in (sender.k_cache(layer), sender.v_cache(layer)):
                values, scales = kv_quant.quantize(
                    torch.randn(pages.data.shape, generator=g), kv_dtype)
                pages.data.copy_(values)
                pages.scale.copy_(scales)
        span = wire.ChunkSpan(0, config.num_layers, 0, sender.num_blocks)
        honest = wire.pack_array(sender, list(range(sender.num_blocks)), span).tobytes()
        hostile = bytearray(honest)
        page = torch.frombuffer(hostile, dtype=torch.uint8).view(-1, pool.page_nbytes)
        page[3, -4:].view(torch.float32)[0] = 1e37  # finite; above float32 max / 127
        _reserve(engine, "A")
        before = engine.pool.cache.clone()
        with pytest.raises(DataLoss, match="dequantizes to inf"):
            engine.receiver.receive_chunk("A", engine.layout, PROMPT, span, bytes(hostile),
                                          wire.crc32(bytes(hostile)))
        assert torch.equal(engine.pool.cache, before)
        assert engine.receiver.receive_chunk("A", engine.layout, PROMPT, span, honest,
                                             wire.crc32(honest)) == len(honest)
    finally:
        engine.steps.executor.shutdown(wait=True)
