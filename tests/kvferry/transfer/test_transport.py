"""The transport registry: every name `--kv-transport` offers loads a package with both ends,
and a decode worker's gRPC server gets the baseline's end and its own, and refuses the rest
of KvTransferService naming the field."""

from __future__ import annotations

import ast
import asyncio
import re
import sys
import time
from pathlib import Path

import grpc
import pytest
import torch

import kvferry.transfer
from decode_worker.kv_receiver import KvReceiver
from decode_worker.receipt import KvReceipt
from decode_worker.sequence import DecodeSeq
from kvferry.cache.budget import blocks_for_tokens
from kvferry.cache.layout import KvLayout
from kvferry.cache.pool import KvPool
from kvferry.faults import Faults
from kvferry.rpc import grpc_util
from kvferry.settings import DEFAULT_KV_TRANSPORT, KV_TRANSPORTS
from kvferry.transfer import transport, wire
from kvferry.transfer.grpc.chunk_codec import KV_TRANSFER_SERVICE
from kvferry.v1 import worker_pb2

NUM_TOKENS = 20
BLOCK_SIZE = 8


def test_every_transport_loads_with_both_ends() -> None:
    assert DEFAULT_KV_TRANSPORT == transport.BASELINE
    for name in KV_TRANSPORTS:
        package = transport.load(name)
        assert callable(package.make_sender) and callable(package.add_receiver), name


def _pool(seed: int | None) -> KvPool:
    pool = KvPool(num_layers=2, num_kv_heads=2, head_dim=8, block_size=BLOCK_SIZE, num_blocks=8,
                  dtype=torch.float32)
    if seed is not None:
        pool.cache.copy_(torch.randn(pool.cache.shape,
                                     generator=torch.Generator().manual_seed(seed)))
    return pool


async def _serve(name: str) -> tuple[grpc.aio.Server, str, KvPool, KvReceiver, list[str]]:
    """A decode worker's KvTransferService with one reservation, `r1`, on a local port."""
    pool = _pool(None)
    layout = KvLayout.of_pool(pool, "fp")
    completed: list[str] = []
    seqs: dict[str, DecodeSeq] = {}
    sink = KvReceiver(layout, pool, seqs, lambda seq: completed.append(seq.request_id))
    blocks = pool.allocator.alloc(blocks_for_tokens(NUM_TOKENS + 1, pool.block_size))
    seqs["r1"] = DecodeSeq("r1", NUM_TOKENS, 4, blocks, time.monotonic() + 60,
                           KvReceipt(wire.coverage(layout, NUM_TOKENS)), arrival=0, lease_s=60)
    server = grpc_util.make_server()
    transport.add_receivers(server, sink, name, Faults())
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}", pool, sink, completed


def _push_through(name: str) -> None:
    """A push from `name`'s sender to its receiving end lands every prompt page."""
    async def run() -> tuple[torch.Tensor, torch.Tensor, list[str]]:
        server, address, pool, sink, completed = await _serve(name)
        source = _pool(seed=5)
        table = [6, 1, 4]
        sender = transport.make_sender(name, transport.SenderOptions())
        try:
            result = await sender.push(address, "r1", sink.layout, NUM_TOKENS, source, table,
                                       30)
        finally:
            await sender.close()
            await server.stop(None)
        assert result.num_bytes > 0
        dest = sink.target("r1").block_table[:3]
        return source.cache[:, :, table], pool.cache[:, :, dest], completed

    sent, landed, completed = asyncio.run(run())
    assert completed == ["r1"]
    full, tail = divmod(NUM_TOKENS, BLOCK_SIZE)  # the last block's tail: the decode side's
    assert torch.equal(sent[:, :, :full], landed[:, :, :full])
    assert torch.equal(sent[:, :, full, :tail], landed[:, :, full, :tail])


def test_the_grpc_end_receives_a_push_from_its_sender() -> None:
    _push_through("grpc")


CONTRIBUTING = Path(__file__).resolve().parents[3] / "docs" / "contributing.md"
EXAMPLE_FILE = re.compile(r"\*\*\d\. [^*]+\*\*, `kvferry/transfer/onecall/(\w+\.py)`.*?"
                          r"```python\n(.*?)```", re.DOTALL)
EXAMPLE_LINE = re.compile(r"\*\*\d\. Register it\*\*.*?```python\n(.*?)```", re.DOTALL)


def test_the_contributing_example_is_a_working_transport(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """docs/contributing.md's transport, its three files and its registration line as the
    page shows them, moves a pool's pages as the gRPC transport does."""
    text = CONTRIBUTING.read_text()
    files = dict(EXAMPLE_FILE.findall(text))
    assert set(files) == {"__init__.py", "send.py", "receive.py"}
    package = tmp_path / "onecall"
    package.mkdir()
    for name, source in files.items():
        (package / name).write_text(source)
    line = EXAMPLE_LINE.search(text)
    assert line is not None
    registration = ast.literal_eval("{" + line.group(1).split("#")[0].strip() + "}")
    assert registration == {"onecall": "kvferry.transfer.onecall"}
    monkeypatch.setattr(kvferry.transfer, "__path__",
                        [*kvferry.transfer.__path__, str(tmp_path)])
    for name, module in registration.items():
        monkeypatch.setitem(KV_TRANSPORTS, name, module)
    try:
        _push_through("onecall")
    finally:
        for module in [m for m in sys.modules if m.startswith("kvferry.transfer.onecall")]:
            del sys.modules[module]


@pytest.mark.parametrize("method", ["PullKv", "SomethingNew"])
def test_methods_no_end_serves_are_refused_naming_the_field(method: str) -> None:
    async def call() -> grpc.aio.AioRpcError:
        server, address, *_ = await _serve("grpc")
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                stream = channel.stream_unary(f"/{KV_TRANSFER_SERVICE}/{method}",
                                              request_serializer=None,
                                              response_deserializer=None)
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await stream(iter([worker_pb2.KvPullMessage().SerializeToString()]),
                                 timeout=30)
                return caught.value
        finally:
            await server.stop(None)

    error = asyncio.run(call())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == (f"kv_transport: this worker runs --kv-transport grpc, which "
                               f"does not serve {method}")


def test_other_services_stay_unimplemented() -> None:
    async def call() -> grpc.StatusCode:
        server, address, *_ = await _serve("grpc")
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                unary = channel.unary_unary("/kvferry.v1.Nothing/Here",
                                            request_serializer=None,
                                            response_deserializer=None)
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await unary(b"", timeout=30)
                return caught.value.code()
        finally:
            await server.stop(None)

    assert asyncio.run(call()) == grpc.StatusCode.UNIMPLEMENTED
