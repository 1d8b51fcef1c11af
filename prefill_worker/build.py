"""How a prefill worker is put together from its settings, on the model and pool
deploy/worker_model.py built: the engine with its K/V sender (the deployment's transport), its
tiers, its draft model where it ships the draft's K/V, and the PrefillService on its gRPC
server. deploy/processes.py starts, serves and stops what `assemble` returns."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from kvferry.cache.layout import KvLayout
from kvferry.cache.pool import KvPool
from kvferry.cache.tiers.build import build_tiered_cache
from kvferry.faults import Faults
from kvferry.model.prefill_batch import token_budget_for
from kvferry.model.transformer import Transformer
from kvferry.rpc import security
from kvferry.settings import WorkerSettings
from kvferry.transfer.sender import KvSender
from prefill_worker import server as prefill_server
from prefill_worker.draft_kv import DraftPrefill
from prefill_worker.engine import PrefillEngine

if TYPE_CHECKING:
    import grpc  # the server a worker's services are added to (deploy/processes.py makes it)

Stop = Callable[[], Awaitable[None]]


def make_sender(settings: WorkerSettings, creds: security.Credentials) -> KvSender:
    """The K/V sender of the deployment's transport (`--kv-transport`)."""
    from kvferry.transfer import transport

    return transport.make_sender(settings.kv_transport, transport.SenderOptions(
        settings.kv_max_resends, creds, Faults.from_env()))  # faults: kvferry/faults.py


def assemble(settings: WorkerSettings, model: Transformer, pool: KvPool, layout: KvLayout,
             server: grpc.aio.Server, creds: security.Credentials,
             draft: DraftPrefill | None) -> tuple[PrefillEngine, Stop, list[str]]:
    """The worker's engine (not started), what stopping it involves, and the names of the
    services it added to `server`. A prompt evicted as it is prefilled is pushed whole over
    NIXL and Ray (the decode worker evicts it); over gRPC with its eviction state."""
    engine = PrefillEngine(model, pool, layout, make_sender(settings, creds),
                           token_budget_for(pool.cache.device, settings.prefill_token_budget),
                           settings.prefill_chunk_size, settings.max_waiting,
                           build_tiered_cache(pool, settings.tiers), draft,
                           settings.kv_eviction if settings.kv_transport == "grpc" else None)
    prefill_server.add_to_server(server, engine)
    return engine, engine.stop, list(prefill_server.SERVICE_NAMES)
