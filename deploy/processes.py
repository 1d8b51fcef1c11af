"""Process bootstrap: build a worker or the router from its settings and serve until SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, NamedTuple, Protocol

import grpc

from deploy.start_log import record_start
from deploy.worker_model import build_draft_prefill, build_model
from kvferry import trace
from kvferry.cache.budget import KvBudget
from kvferry.cache.layout import KvLayout
from kvferry.model.config import load_model_config
from kvferry.rpc import grpc_util, security
from kvferry.settings import RouterSettings, SecuritySettings, WorkerSettings

if TYPE_CHECKING:
    from decode_worker.engine import DecodeEngine
    from prefill_worker.engine import PrefillEngine
    from router.engine import Router
    from router.http.front import HttpFront
    from router.workers.registry import WorkerSet

log = logging.getLogger("kvferry")


class Drainable(Protocol):
    """A worker engine: refuses new work once drain() is called; idle when nothing is left."""

    def drain(self) -> None: ...

    @property
    def is_idle(self) -> bool: ...


class Built(NamedTuple):
    """A server that is built but not started, and what stopping it involves."""

    server: grpc.aio.Server
    health: object  # grpc_health.v1.health.aio.HealthServicer
    service_names: list[str]
    port: int
    on_stop: Callable[[], Awaitable[None]]
    drain_timeout_s: float
    engine: Drainable | None = None  # workers; the router drains through the server's grace
    metrics_port: int = 0  # bound Prometheus port; 0: no metrics server
    health_server: grpc.aio.Server | None = None  # plaintext health-only port (TLS setups)
    http: HttpFront | None = None  # the router's OpenAI-compatible API (--http-port)
    workers: WorkerSet | None = None  # the router's workers (a Ray deployment scales them)


async def start(built: Built) -> None:
    record_start("server", ",".join(name.rsplit(".", 1)[-1] for name in built.service_names))
    await built.server.start()
    if built.health_server is not None:
        await built.health_server.start()
    if built.http is not None:
        await built.http.start()
    await grpc_util.set_serving(built.health, built.service_names, True)


async def stop(built: Built) -> None:
    """Drain, then release: report NOT_SERVING (routers stop choosing this server), refuse
    new requests, let the ones in flight finish for up to drain_timeout_s, then cancel what
    is left (routers migrate those streams) and free everything."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + built.drain_timeout_s
    log.info("draining (up to %.1f s)", built.drain_timeout_s)
    await grpc_util.set_serving(built.health, built.service_names, False)
    grace = built.drain_timeout_s
    if built.engine is not None:
        # Workers keep accepting RPCs for requests already admitted (K/V pushes, decode
        # streams), so the server stays open until the engine is idle.
        built.engine.drain()
        while not built.engine.is_idle and loop.time() < deadline:
            await asyncio.sleep(0.05)
        # Idle: a moment for the last messages to flush. Timed out: cut what is left now, so
        # routers migrate those streams instead of waiting on a worker that is going away.
        grace = 1.0 if built.engine.is_idle else 0.0
    if built.http is not None:  # both fronts drain at once, then stop
        await asyncio.gather(built.server.stop(grace=grace), built.http.stop())
    else:
        await built.server.stop(grace=grace)
    if built.health_server is not None:
        await built.health_server.stop(grace=None)
    await built.on_stop()
    log.info("stopped")


async def _serve(built: Built, role: str) -> None:
    await start(built)
    tracer = trace.start(role)  # KVFERRY_TRACE_DIR: per-token attribution (kvferry/trace.py)
    lag_probe = asyncio.create_task(tracer.watch_loop_lag()) if tracer else None
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):  # before "ready": a SIGTERM then drains too
        loop.add_signal_handler(sig, stopping.set)
    if not grpc_util.announce_ready(built.port, built.metrics_port,
                                    None if built.http is None else built.http.port):
        stopping.set()  # the launcher is gone: stop at once, as on SIGTERM
    set_on_fatal = getattr(built.engine, "set_on_fatal", None)
    if set_on_fatal is not None:  # a worker that can no longer serve drains and exits
        set_on_fatal(stopping.set)
    await stopping.wait()
    if lag_probe is not None:
        lag_probe.cancel()
    await stop(built)


def _then(stop: Callable[[], Awaitable[None]], close: Callable[[], None]
          ) -> Callable[[], Awaitable[None]]:
    async def both() -> None:
        await stop()
        close()

    return both


def build_worker(settings: WorkerSettings) -> tuple[Built, object]:
    """The worker's server (not started) and its engine (started: needs a running loop),
    put together by its role's own `build.assemble`."""
    model, pool, backend_name = build_model(settings)
    close_model = getattr(model, "close", None)  # a tensor-parallel group: its ranks
    layout = KvLayout.of_pool(pool, model.config.fingerprint)
    creds = security.load(settings.security)
    server = grpc_util.make_server(interceptors=security.server_interceptors(creds))
    health = grpc_util.add_health(server)
    engine: DecodeEngine | PrefillEngine
    if settings.role in ("decode", "colocated"):
        from decode_worker import build as decode_build

        engine, on_stop, names = decode_build.assemble(settings, model, pool, layout,
                                                       backend_name, server)
    else:
        from prefill_worker import build as prefill_build

        engine, on_stop, names = prefill_build.assemble(
            settings, model, pool, layout, server, creds,
            build_draft_prefill(settings, model, pool))
    if close_model is not None:
        on_stop = _then(on_stop, close_model)
    engine.start()
    grpc_util.add_reflection(server, names)
    # Internal server: a CA means client certificates are required (mTLS).
    port = security.add_port(server, f"{settings.host}:{settings.port}", creds,
                             require_client_auth=settings.security.tls_ca is not None)
    from kvferry.model.identity import served_model_name

    log.info("%s worker on %s:%d ready: %s, K/V for %s tokens (%d blocks of %d), %s, %s, "
             "backend %s, %s K/V transport", settings.role, settings.host, port,
             served_model_name(str(model.config.path)), f"{pool.num_blocks * pool.block_size:,}",
             pool.num_blocks, pool.block_size, model.dtype, model.device, backend_name,
             settings.kv_transport)
    return Built(server, health, names, port, on_stop, settings.drain_timeout_s,
                 engine, _worker_metrics(settings, engine, pool.cache.nbytes),
                 _health_server(health, settings.host, settings.security)), engine


def _worker_metrics(settings: WorkerSettings, engine: object, pool_bytes: int) -> int:
    """Serve the worker's Prometheus metrics with --metrics-port; their port (0: none)."""
    if settings.metrics_port is None:
        return 0
    from kvferry.rpc import metrics

    registry = metrics.CollectorRegistry()
    kv_bytes = ((lambda: engine.kv_bytes_sent) if settings.role == "prefill"
                else (lambda: engine.kv_bytes_received))
    registry.register(metrics.WorkerCollector(settings.role, engine.stats, kv_bytes,
                                              pool_bytes))
    return metrics.serve(settings.metrics_port, settings.host, registry)


async def run_worker(settings: WorkerSettings) -> None:
    built, _ = build_worker(settings)
    await _serve(built, settings.role)


async def build_router(settings: RouterSettings) -> Built:
    from transformers import AutoTokenizer

    from kvferry.model.identity import served_model_name
    from router import server as router_server
    from router.engine import Router
    from router.identity import ApiKeys
    from router.policies import make_policy
    from router.workers.leases import renew_loop

    config = load_model_config(settings.model, settings.override_generation_config,
                               settings.load_format)
    tokenizer = AutoTokenizer.from_pretrained(config.path)  # a .gguf model: its converted dir
    creds = security.load(settings.security)
    workers, tasks = await _router_workers(settings, config.fingerprint, creds)
    policy = make_policy(settings.policy, settings.prefix_weight, settings.load_weight,
                         settings.prefill_prefix_weight, settings.demand_weight)
    router = Router(config, tokenizer, workers, settings.lease_s, policy,
                    settings.local_prefill_threshold, limits=settings.limits,
                    is_prompt_tokens_details=settings.is_prompt_tokens_details,
                    kv_budget=KvBudget(settings.kv_eviction))
    keys = ApiKeys(settings.api_keys)
    if keys.is_enabled and not settings.security.is_tls:
        log.warning("API keys on plaintext public ports: keys travel in the clear unless a "
                    "TLS-terminating proxy fronts the router (--tls-cert/--tls-key)")
    log.info("router instance %s: downstream request ids are <id>@%s", router.instance_id,
             router.instance_id)
    tasks.append(asyncio.create_task(_refresh_loop(workers)))
    tasks.append(asyncio.create_task(renew_loop(router.open.states, settings.lease_s)))
    # Public: a smaller receive cap, no token check (clients are not cluster members).
    server = grpc_util.make_server(max_receive_bytes=grpc_util.PUBLIC_MAX_RECEIVE_BYTES)
    health = grpc_util.add_health(server)
    router_metrics, metrics_port = _router_metrics(settings, router)
    model_name = served_model_name(settings.model, settings.served_model_name)
    router_server.add_to_server(server, router, router_metrics, keys, model_name)
    grpc_util.add_reflection(server, router_server.SERVICE_NAMES)
    port = security.add_port(server, f"{settings.host}:{settings.port}", creds,
                             require_client_auth=settings.is_public_client_auth)
    http = None
    if settings.http_port is not None:
        from router.http.front import HttpFront

        http = HttpFront(router, settings.model, settings.host, settings.http_port,
                         settings.security, settings.is_public_client_auth, router_metrics,
                         settings.drain_timeout_s, keys, model_name)

    async def on_stop() -> None:
        for task in tasks:
            task.cancel()
        await workers.close()

    return Built(server, health, router_server.SERVICE_NAMES, port, on_stop,
                 settings.drain_timeout_s, None, metrics_port,
                 _health_server(health, settings.host, settings.security), http, workers)


async def _router_workers(settings: RouterSettings, fingerprint: str,
                          creds: security.Credentials) -> tuple[WorkerSet, list[asyncio.Task]]:
    """The router's workers, connected and refreshed once, and the task that rediscovers
    them by DNS (when named by a headless Service)."""
    from router.workers.registry import WorkerSet

    workers = WorkerSet.connect(list(settings.prefill), list(settings.decode), fingerprint,
                                list(settings.colocated), creds)
    dns_names = {role: name for role, name in (("prefill", settings.prefill_dns),
                                               ("decode", settings.decode_dns)) if name}
    tasks = []
    if dns_names:
        from router.workers.discovery import discover_once, discovery_loop

        await discover_once(workers, dns_names)
        tasks.append(asyncio.create_task(
            discovery_loop(workers, dns_names, settings.dns_interval_s)))
    await workers.refresh_all()
    return workers, tasks


def _router_metrics(settings: RouterSettings, router: Router) -> tuple[object, int]:
    """The router's Prometheus metrics, and their port with --metrics-port (else 0). With
    an HTTP front they are kept anyway: its /metrics serves them, as vLLM's API port does."""
    if settings.metrics_port is None and settings.http_port is None:
        return None, 0
    from kvferry.rpc import metrics

    registry = metrics.CollectorRegistry()
    router_metrics = metrics.RouterMetrics(registry)
    registry.register(metrics.RouterWorkersCollector(lambda: router.workers.workers))
    router.prefill.on_retry = router_metrics.prefill_retries.inc
    if settings.metrics_port is None:
        return router_metrics, 0
    return router_metrics, metrics.serve(settings.metrics_port, settings.host, registry)


def _health_server(health: object, host: str,
                   sec: SecuritySettings) -> grpc.aio.Server | None:
    if sec.health_port is None:
        return None
    server, port = security.health_only_server(health, f"{host}:{sec.health_port}")
    log.info("plaintext health checks on %s:%d", host, port)
    return server


async def run_router(settings: RouterSettings) -> None:
    await _serve(await build_router(settings), "router")


async def _refresh_loop(workers, interval_s: float = 0.2) -> None:
    while True:
        await asyncio.sleep(interval_s)
        await workers.refresh_all()
