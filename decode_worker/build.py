"""How a decode (or colocated) worker is put together from its settings, on the model and pool
deploy/worker_model.py built: the engine with its tiers, its draft model (`--speculative-method
draft`) and its dense K/V stage, and the services on its gRPC server (the DecodeService, a
local PrefillService, the K/V transport's receiving end). deploy/processes.py starts, serves
and stops what `assemble` returns."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from decode_worker import server as decode_server
from decode_worker.engine import DecodeEngine
from decode_worker.kv_stage import reads_pages_in_place, stage_bytes_for_pool
from decode_worker.spec.draft_model import DraftModel, check_draft, draft_pool
from kvferry.cache.layout import KvLayout, dtype_name
from kvferry.cache.pool import KvPool
from kvferry.cache.tiers.build import build_tiered_cache
from kvferry.faults import Faults
from kvferry.model.config import load_model_config
from kvferry.model.prefill_batch import token_budget_for
from kvferry.model.transformer import Transformer
from kvferry.settings import WorkerSettings

if TYPE_CHECKING:
    import grpc  # the server a worker's services are added to (deploy/processes.py makes it)

log = logging.getLogger("kvferry.worker")

Stop = Callable[[], Awaitable[None]]


def assemble(settings: WorkerSettings, model: Transformer, pool: KvPool, layout: KvLayout,
             backend_name: str, server: grpc.aio.Server
             ) -> tuple[DecodeEngine, Stop, list[str]]:
    """The worker's engine (not started), what stopping it involves, and the names of the
    services it added to `server`."""
    from kvferry.transfer import transport

    engine = DecodeEngine(model, pool, layout, settings.max_waiting,
                          stage_bytes=stage_bytes(settings, pool, backend_name),
                          max_model_len=settings.max_model_len,
                          cache=build_tiered_cache(pool, settings.tiers),
                          token_budget=token_budget_for(pool.cache.device,
                                                        settings.prefill_token_budget),
                          chunk_size=settings.prefill_chunk_size,
                          speculative=settings.speculative,
                          eviction=settings.kv_eviction,
                          draft=build_draft(settings, model, pool))
    close_receivers = transport.add_receivers(server, engine.receiver, settings.kv_transport,
                                              Faults.from_env())  # faults: kvferry/faults.py

    async def stop() -> None:
        await engine.stop()
        close_receivers()

    decode_server.add_to_server(server, engine, settings.role)
    return engine, stop, list(decode_server.SERVICE_NAMES)


def stage_bytes(settings: WorkerSettings, pool: KvPool, backend_name: str) -> int:
    """The decode stage's budget (decode_worker/kv_stage.py): --decode-stage-mib, or by default
    as much K/V as the pool holds where attention would otherwise gather pages every step."""
    if (backend_name != "torch" or settings.speculative.is_on  # speculation reads the pages
            or settings.kv_eviction.policy == "h2o"  # the stage reports no attention mass
            or settings.tensor_parallel_size > 1):  # the stage is not mirrored on the ranks
        return 0
    if settings.decode_stage_mib is not None:
        return settings.decode_stage_mib << 20
    kv_dtype = "quantized" if pool.is_quantized else dtype_name(pool.dtype)
    return 0 if reads_pages_in_place(pool.cache.device, kv_dtype) else stage_bytes_for_pool(pool)



def build_draft(settings: WorkerSettings, model: Transformer, pool: KvPool
                ) -> DraftModel | None:
    """The draft model of `--speculative-method draft` (None otherwise): on the target's
    device and dtype, with a pool of the target pool's blocks (ValueError naming the flag
    when its vocabulary differs)."""
    if settings.speculative.method != "draft":
        return None
    config = load_model_config(settings.speculative.model, load_format=settings.load_format)
    draft = Transformer(config, model.backend, model.dtype, model.device)
    check_draft(model, draft)
    built = DraftModel(draft, draft_pool(draft, pool))
    log.info("draft model %s: %d layers, its K/V pool %d blocks", settings.speculative.model,
             config.num_layers, built.pool.num_blocks)
    return built
