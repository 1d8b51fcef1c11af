"""The router's shared DecodeStream to a decode worker (router/workers/decode_client.py) ended
by the worker: the requests on it fail with StreamBroken, and the task gRPC runs to send the
stream's commands ends with it. gRPC does not cancel that task once the other end closed the
call; left waiting on the commands, it was destroyed pending ("Task was destroyed but it is
pending!" in routers' logs, once per worker restart)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvferry.model.sampling import SamplingParams
from kvferry.v1 import worker_pb2_grpc
from router.records import DecodeStart
from router.workers.decode_client import DecodeClient, StreamBroken
from tests.waiting import until, within


class _EndsAfterOneCommand(worker_pb2_grpc.DecodeServiceServicer):
    """A decode worker that reads the stream's first command, then ends the call."""

    def __init__(self) -> None:
        self.commands: list[str] = []

    async def DecodeStream(self, request_iterator, context):  # noqa: N802 - gRPC's name
        async for command in request_iterator:
            self.commands.append(command.start.request_id)
            return


def _senders() -> list[asyncio.Task[object]]:
    return [t for t in asyncio.all_tasks() if not t.done()
            and "_consume_request_iterator" in repr(t.get_coro())]


def test_a_stream_the_worker_ended_fails_its_requests_and_stops_sending() -> None:
    async def run() -> None:
        server = grpc.aio.server()
        worker = _EndsAfterOneCommand()
        worker_pb2_grpc.add_DecodeServiceServicer_to_server(worker, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                client = DecodeClient(channel)
                call = client.start(DecodeStart("r1", 5, SamplingParams(max_tokens=4), 3, [],
                                                0), None)
                with pytest.raises(StreamBroken):
                    await within(call.next(), "the request failing with the stream")
                assert worker.commands == ["r1"]
                await until(lambda: not _senders(), "gRPC's command sender ending")
                call.close()
                await client.close()
        finally:
            await server.stop(None)

    asyncio.run(run())
