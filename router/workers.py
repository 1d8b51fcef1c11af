"""The router's view of its workers: channels, layouts, load, and the choice of worker.

Decode choice is by K/V headroom: free blocks from the worker's last stats, minus the blocks
this router has reserved there since (in-flight accounting, so a burst of requests does not
pile onto one worker on stale telemetry). Prefill choice: fewest requests in flight.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import grpc

from kvferry import grpc_util, transport, wire
from kvferry.errors import Unavailable
from kvferry.v1 import worker_pb2, worker_pb2_grpc
from router.decode_mux import DecodeMux

log = logging.getLogger("kvferry.router")


@dataclass(slots=True)
class Worker:
    address: str
    role: str  # "prefill", "decode" or "colocated" (serves both)
    channel: grpc.aio.Channel
    layout: wire.KvLayout | None = None
    free_blocks: int = 0
    in_flight_blocks: int = 0  # reserved by this router since the last stats refresh
    num_in_flight: int = 0
    is_healthy: bool = False
    refuse_reason: str = ""
    mux: DecodeMux | None = None  # decode and colocated workers: the shared DecodeStream

    @property
    def prefill(self) -> worker_pb2_grpc.PrefillServiceStub:
        return worker_pb2_grpc.PrefillServiceStub(self.channel)

    @property
    def decode(self) -> worker_pb2_grpc.DecodeServiceStub:
        return worker_pb2_grpc.DecodeServiceStub(self.channel)

    @property
    def headroom(self) -> int:
        return self.free_blocks - self.in_flight_blocks


@dataclass
class WorkerSet:
    """All workers, checked for compatibility with the served model before use."""

    expected_fingerprint: str
    workers: list[Worker] = field(default_factory=list)

    @staticmethod
    def connect(prefill: list[str], decode: list[str], fingerprint: str,
                colocated: list[str] | None = None) -> WorkerSet:
        ws = WorkerSet(fingerprint)
        for role, addresses in (("prefill", prefill), ("decode", decode),
                                ("colocated", colocated or [])):
            for address in addresses:
                chan = grpc_util.channel(address)
                mux = DecodeMux(chan) if role != "prefill" else None
                ws.workers.append(Worker(address, role, chan, mux=mux))
        return ws

    async def refresh(self, worker: Worker, timeout_s: float = 5.0) -> None:
        stub = worker.prefill if worker.role == "prefill" else worker.decode
        try:
            stats = await stub.GetStats(worker_pb2.GetStatsRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            worker.is_healthy = False
            log.warning("%s worker %s unreachable: %s", worker.role, worker.address,
                        exc.code().name)
            return
        layout = transport.layout_from_proto(stats.layout)
        reason = self._incompatibility(layout)
        if reason:
            if worker.refuse_reason != reason:
                log.error("refusing %s worker %s: %s", worker.role, worker.address, reason)
            worker.refuse_reason = reason
            worker.is_healthy = False
            return
        worker.layout = layout
        worker.free_blocks = stats.free_blocks
        worker.in_flight_blocks = 0
        worker.is_healthy = True
        worker.refuse_reason = ""

    def _incompatibility(self, layout: wire.KvLayout) -> str:
        if layout.model_fingerprint != self.expected_fingerprint:
            return (f"model fingerprint {layout.model_fingerprint} != served "
                    f"{self.expected_fingerprint}")
        reference = next((w.layout for w in self.workers if w.layout is not None), None)
        if reference is not None:
            problem = reference.mismatch(layout)
            if problem:
                return problem
        return ""

    async def refresh_all(self) -> None:
        for worker in self.workers:
            await self.refresh(worker)

    def _healthy(self, *roles: str) -> list[Worker]:
        return [w for w in self.workers if w.role in roles and w.is_healthy]

    def has_prefill_workers(self) -> bool:
        return any(w.role == "prefill" for w in self.workers)

    def decode_candidates(self) -> list[Worker]:
        """Healthy decode workers, most headroom first, ties to the fewest in flight."""
        workers = self._healthy("decode", "colocated")
        if not workers:
            raise Unavailable("no healthy decode worker")
        return sorted(workers, key=lambda w: (-w.headroom, w.num_in_flight))

    def pick_prefill(self) -> Worker:
        workers = self._healthy("prefill")
        if not workers:
            raise Unavailable("no healthy prefill worker")
        return min(workers, key=lambda w: w.num_in_flight)

    async def close(self) -> None:
        for worker in self.workers:
            if worker.mux is not None:
                await worker.mux.close()
            await worker.channel.close()
