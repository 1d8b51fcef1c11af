"""A deployment on Ray: router and workers as Ray actors, K/V pages as Ray object refs.

Each actor runs the same gRPC server a `kvferry *-worker` / `kvferry router` process runs,
built from the same settings (the driver parses the command line and hands the actor the
frozen settings objects), so the control path (router, Generate, Reserve, Decode)
is identical to the process deployment; only the prefill -> decode page transfer changes
(kvferry.transfer.ray.send). A local Ray instance is started unless `ray_address` names a
cluster (or Ray is already initialized, as in the test session); it authenticates every
connection with Ray's token mode (`start_local_ray`). Workers ask Ray for one GPU each when
the cluster has GPUs; the router actor goes on the head node.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import ray

from deploy.child_env import router_secrets_hidden, without_router_secrets
from deploy.launcher import Deployment, serves
from deploy.placement import placed_argv
from deploy.start_log import record_start
from kvferry.cache.layout import KvLayout
from kvferry.settings import RouterSettings, WorkerSettings
from kvferry.transfer.ray.send import NAMESPACE, ChunkAck, PushBegun
from kvferry.transfer.wire import ChunkSpan

if TYPE_CHECKING:
    from router.workers.registry import WorkerSet

log = logging.getLogger("kvferry.ray")

HEAD_RESOURCE = "node:__internal_head__"  # Ray's built-in resource of the head node
RAY_AUTH_MODE_ENV = "RAY_AUTH_MODE"


def start_local_ray(**options: object) -> object:
    """Start a local Ray instance whose every connection (GCS, raylet, object manager, Ray
    client) needs a token. Ray 2.60 does this for a new local instance unless RAY_AUTH_MODE
    says otherwise: it makes a token (~/.ray/auth_token, or RAY_AUTH_TOKEN /
    RAY_AUTH_TOKEN_PATH when set) that the processes it starts inherit, and refuses anything
    without it (tests/deploy/test_ray_auth.py holds Ray to that)."""
    mode = os.environ.get(RAY_AUTH_MODE_ENV)
    if mode is not None and mode.lower() != "token":
        log.warning("%s=%s: this Ray instance authenticates nothing, and anything that reaches "
                    "its ports can run code here", RAY_AUTH_MODE_ENV, mode)
    with router_secrets_hidden():  # its processes copy the environment; no actor reads them
        return ray.init(**options)


@dataclass(frozen=True)
class ActorStart:
    """What an actor runs: the settings a `kvferry ARGV` command line gives, parsed by the
    driver (the actor is handed frozen settings, as a process is handed its flags)."""

    settings: WorkerSettings | RouterSettings
    log_level: str
    log_format: str

    @staticmethod
    def of(argv: list[str]) -> ActorStart:
        from deploy import args as command_line

        args = command_line.build_parser().parse_args(argv)
        settings = (command_line.router_settings(args) if args.command == "router"
                    else command_line.worker_settings(args))
        return ActorStart(settings, args.log_level, args.log_format)


class ServerActor:
    """One kvferry server (router or worker) inside a Ray actor, on the actor's event loop."""

    def __init__(self) -> None:
        from kvferry.transfer.ray.receive import RayKvReceiver

        self._built = None
        # The decode worker's end of Ray K/V pushes; refuses them unless this actor decodes.
        self._receiver = RayKvReceiver(None)
        self._address = ""
        self._http_address = ""  # the router's OpenAI-compatible API, when it serves one
        self._metrics_address = ""  # its Prometheus endpoint, with --metrics-port
        # A router's workers by role as the deployment last named them (`set_workers`),
        # applied again every second so that a worker that left is dropped once idle.
        self._named: dict[str, set[str]] = {}
        self._follow: asyncio.Task | None = None

    async def start(self, start: ActorStart) -> str:
        """Build and start the server `start` describes; its address."""
        from deploy import processes
        from kvferry import logs

        logs.setup(start.log_level, start.log_format)
        settings = start.settings
        if isinstance(settings, RouterSettings):
            self._built = await processes.build_router(settings)
        else:
            self._built, engine = processes.build_worker(settings)
            if settings.role != "prefill":
                from kvferry.transfer.ray.receive import RayKvReceiver

                self._receiver = RayKvReceiver(engine.receiver)
        await processes.start(self._built)
        host = settings.host
        if host in ("0.0.0.0", "::", ""):
            host = ray.util.get_node_ip_address() if ray.is_initialized() else socket.getfqdn()
        self._address = f"{host}:{self._built.port}"
        if self._built.http is not None:
            self._http_address = f"{host}:{self._built.http.port}"
        if self._built.metrics_port:
            self._metrics_address = f"{host}:{self._built.metrics_port}"
        return self._address

    async def address(self) -> str:
        return self._address

    async def http_address(self) -> str:
        return self._http_address

    async def metrics_address(self) -> str:
        return self._metrics_address

    async def pid(self) -> int:
        return os.getpid()

    def _router_workers(self) -> WorkerSet:
        if self._built is None or self._built.workers is None:
            raise ValueError("only a running router has workers to set")
        return self._built.workers

    async def set_workers(self, role: str, addresses: list[str]) -> None:
        """A router's workers of `role` become exactly `addresses`: a new one is connected,
        one no longer named gets no new request and is dropped once nothing is open there
        (router.workers.registry.WorkerSet.sync_role). Only Ray's authenticated members can call
        an actor, so this needs no port of its own."""
        workers = self._router_workers()
        self._named[role] = set(addresses)
        await workers.sync_role(role, self._named[role])
        if self._follow is None:
            self._follow = asyncio.create_task(self._follow_named(workers))

    async def _follow_named(self, workers: WorkerSet) -> None:
        while True:
            await asyncio.sleep(1.0)
            for role, addresses in list(self._named.items()):
                await workers.sync_role(role, addresses)

    async def worker_loads(self) -> dict[str, int]:
        """A router's workers by address: the requests it has open on each now."""
        return {w.address: w.num_in_flight for w in self._router_workers().workers}

    async def stop(self) -> None:
        """Drain (--drain-timeout-s) and stop the server."""
        from deploy import processes

        if self._follow is not None:
            self._follow.cancel()
            self._follow = None
        if self._built is not None:
            await processes.stop(self._built)
            self._built = None

    # K/V push methods (kvferry.transfer.ray.send calls them): the receiver holds the epochs.
    async def begin_push(self, request_id: str) -> PushBegun:
        return self._receiver.begin(request_id)

    async def push_chunk(self, request_id: str, layout: KvLayout, num_tokens: int,
                         span: ChunkSpan, data: bytes, crc32: int, epoch: int) -> ChunkAck:
        return self._receiver.push_chunk(request_id, layout, num_tokens, span, data, crc32,
                                         epoch)

    async def finish_push(self, request_id: str, epoch: int) -> ChunkAck:
        return self._receiver.finish(request_id, epoch)

    async def fail_push(self, request_id: str, epoch: int) -> None:
        self._receiver.fail(request_id, epoch)


@dataclass
class RayActor:
    name: str
    handle: ray.actor.ActorHandle
    address: str = ""


@dataclass
class RayDeployment(Deployment):
    """`Deployment`'s interface (start/stop/addresses/router_address), on Ray actors."""

    ray_address: str | None = None
    actors: list[RayActor] = field(default_factory=list)
    _owns_ray: bool = False
    _next_index: int = 0  # the highest worker index yet (add_worker counts on from it)

    def _actor_gpus(self, role: str) -> float:
        """A worker's GPUs where the cluster has them: one per rank of its model (its
        --tensor-parallel-size; the ranks are processes the actor starts, on the GPUs Ray
        gives it, so one actor's request keeps them on one node)."""
        if ray.cluster_resources().get("GPU", 0) < 1:
            return 0.0
        return float(self.tensor_parallel_size(role))

    def _actor(self, name: str, num_gpus: float) -> RayActor:
        options: dict[str, object] = {"name": f"{name}-{id(self):x}", "namespace": NAMESPACE,
                                      "num_cpus": 0, "num_gpus": num_gpus}
        if name == "router" and HEAD_RESOURCE in ray.cluster_resources():
            # On the head node, where the cluster's entry point (a Service) points.
            options["resources"] = {HEAD_RESOURCE: 0.001}
        if self.env:  # the router actor is handed its API keys in its settings
            options["runtime_env"] = {"env_vars": without_router_secrets(self.env)}
        return RayActor(name, ray.remote(ServerActor).options(**options).remote())

    def start(self, timeout_s: float | None = None) -> RayDeployment:
        if timeout_s is None:
            timeout_s = 180.0 if self.compile == "off" else 1800.0
        record_start("ray-deployment", self.shape)
        if not ray.is_initialized():
            options = {"namespace": NAMESPACE, "include_dashboard": False,
                       "log_to_driver": False}
            if self.ray_address is None:
                start_local_ray(**options)
            else:  # the cluster's own auth settings apply (RAY_AUTH_MODE, RAY_AUTH_TOKEN)
                ray.init(address=self.ray_address, **options)
            self._owns_ray = True
        try:
            workers = [self._actor(name, self._actor_gpus(name.rsplit("-", 1)[0]))
                       for name in self._worker_names()]
            self._next_index = len(workers)
            self.actors = list(workers)
            starts = [w.handle.start.remote(ActorStart.of(
                self._worker_args(w.name.rsplit("-", 1)[0]))) for w in workers]
            for worker, address in zip(workers, ray.get(starts, timeout=timeout_s)):
                worker.address = address
            args = self._router_args(self.host, {w.name: w.address for w in workers})
            router = self._actor("router", 0.0)
            self.actors.append(router)
            router.address = ray.get(router.handle.start.remote(ActorStart.of(args)),
                                     timeout=timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def _router(self) -> RayActor:
        return self.actors[-1]

    def _name_workers(self, role: str) -> None:
        """Tell the router which workers of `role` it has now."""
        ray.get(self._router.handle.set_workers.remote(role, self.addresses(role)), timeout=60)

    def add_worker(self, role: str, timeout_s: float = 180.0) -> str:
        """Start one more worker of `role` (prefill or decode) and hand it to the router once
        it serves; its name."""
        if role not in ("prefill", "decode") or self.is_colocated:
            raise ValueError(f"role: a disaggregated deployment adds prefill or decode "
                             f"workers, not {role!r}")
        # a name never used in this deployment: Ray may not have released a killed one's yet
        self._next_index += 1
        worker = self._actor(f"{role}-{self._next_index}", self._actor_gpus(role))
        try:
            worker.address = ray.get(worker.handle.start.remote(
                ActorStart.of(self._worker_args(role))), timeout=timeout_s)
        except BaseException:
            ray.kill(worker.handle)
            raise
        self.actors.insert(len(self.actors) - 1, worker)  # the router stays last
        self._name_workers(role)
        self._count(role, +1)
        return worker.name

    def remove_worker(self, role: str, grace_s: float = 600.0) -> str:
        """Take the worker of `role` with the fewest open requests out, without failing
        any: the router stops choosing it at once, then it drains (a prefill worker until
        every push it made is acknowledged, a decode worker until its streams end, or past
        --drain-timeout-s until the router has migrated them) and ends. Its name."""
        mine = [a for a in self.actors if serves(a.name, role)]
        if len(mine) <= 1:
            raise ValueError(f"role: the last {role} worker stays")
        loads = ray.get(self._router.handle.worker_loads.remote(), timeout=60)
        leaving = min(mine, key=lambda a: (loads.get(a.address, 0), -self.actors.index(a)))
        self.actors.remove(leaving)
        self._name_workers(role)
        try:
            ray.get(leaving.handle.stop.remote(), timeout=grace_s)
        finally:
            ray.kill(leaving.handle)
        self._name_workers(role)  # drained: nothing is open there any more
        self._count(role, -1)
        return leaving.name

    def _count(self, role: str, change: int) -> None:
        if role == "prefill":
            self.num_prefill += change
        else:
            self.num_decode += change

    def _router_endpoint(self, method: str, refusal: str) -> str:
        """One of the router actor's addresses (`method`); ValueError `refusal` if none."""
        address = ray.get(getattr(self._router.handle, method).remote(), timeout=30)
        if not address:
            raise ValueError(refusal)
        return address

    @property
    def metrics_address(self) -> str:
        """The router's Prometheus endpoint (HOST:PORT), with --metrics-port."""
        return self._router_endpoint(
            "metrics_address", "metrics_port: this deployment's router serves no metrics")

    def _worker_args(self, role: str) -> list[str]:
        extra = ["--kv-transport", "ray"] if role == "prefill" else []
        # Ray places its actors: no cores of their own, so an auto thread count is the default
        return [*super()._worker_args(role), *extra, *placed_argv(None, role, self.torch_threads),
                *self._memory_argv()]

    @property
    def router_address(self) -> str:
        return self._router.address

    @property
    def http_address(self) -> str:
        return self._router_endpoint(
            "http_address", "http_port: this deployment's router serves no HTTP API")

    def addresses(self, role: str) -> list[str]:
        return [a.address for a in self.actors if serves(a.name, role)]

    def pids(self) -> dict[str, int]:
        """Each actor's process id, by name ("router", "decode-0", ...): on this node."""
        found = ray.get([a.handle.pid.remote() for a in self.actors], timeout=60)
        return {a.name: pid for a, pid in zip(self.actors, found)}

    def dead(self) -> list[str]:
        """Names of actors that no longer answer."""
        gone = []
        for actor in self.actors:
            try:
                ray.get(actor.handle.address.remote(), timeout=10)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                gone.append(actor.name)
        return gone

    def stop(self, grace_s: float = 10.0) -> list[int | None]:
        """Drain every server (router first), then end the actors (and Ray, if ours)."""
        for actor in reversed(self.actors):
            try:
                ray.get(actor.handle.stop.remote(), timeout=grace_s)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
                log.warning("%s did not stop cleanly: %s", actor.name, exc)
            ray.kill(actor.handle)
        self.actors = []
        if self._owns_ray:
            ray.shutdown()
            self._owns_ray = False
        return []
