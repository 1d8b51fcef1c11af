"""What tests do to a running deployment instead of starting another one: a router with flags
of its own against the deployment's workers, a decode worker killed under a stream, and a
killed worker started again at its address (the deployment's router reconnects to it, as to
a restarted pod)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from deploy import client, zygote
from deploy.launcher import Deployment, Process, _spawn
from kvferry.rpc import grpc_util
from kvferry.v1 import generation_pb2, generation_pb2_grpc
from tests.conftest import busy_process
from tests.waiting import until_sync

READY_TIMEOUT_S = 180.0


def _stop(proc: Process, grace_s: float = 10.0) -> int:
    if proc.popen.poll() is None:
        proc.popen.send_signal(signal.SIGTERM)
        proc.popen.send_signal(signal.SIGCONT)
    try:
        return proc.popen.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.popen.kill()
        return proc.popen.wait()


def _is_router(proc: Process) -> bool:
    return proc.name == "router" or proc.name.startswith("router-")


@contextmanager
def routed(deployment: Deployment, name: str, router_args: list[str], is_http: bool = False,
           only: list[str] | None = None) -> Iterator[Deployment]:
    """The deployment's workers (those named in `only`, if given) behind a router of their
    own (flags `router_args` only, logging to `<name>.log`), as a view: a Deployment whose
    router is the new one. Never stop the view: on exit its router stops, the workers go on
    serving their deployment. Workers tell the routers' requests apart by router instance."""
    workers = [p for p in deployment.processes
               if not _is_router(p) and (only is None or p.name in only)]
    view = dataclasses.replace(deployment, router_args=router_args, router_port=0,
                               http_port=0 if is_http else None, processes=workers)
    args = view._router_args(deployment.host, {p.name: p.address for p in workers})
    proc = _spawn(name, args, deployment.log_dir, deployment.env)
    try:
        proc.wait_ready(READY_TIMEOUT_S)
        view.processes = [*workers, proc]
        yield view
    finally:
        _stop(proc)


def respawn(name: str, deployment: Deployment, *views: Deployment,
            extra_args: tuple[str, ...] = ()) -> Process:
    """Start worker `name` of `deployment` again at the address it had, with the flags it
    had and then `extra_args` (a flag given twice takes its last value; its log goes on in
    the same file), in place of the process that exited or was killed, there and in `views`
    of it."""
    (proc,) = _respawn([name], deployment, views, extra_args)
    return proc


def _respawn(names: list[str], deployment: Deployment, views: tuple[Deployment, ...],
             extra_args: tuple[str, ...], extra_env: dict[str, str] | None = None
             ) -> list[Process]:
    """`respawn` for several workers at once: all start, then all are waited for."""
    started = []
    for name in names:
        old = next(p for p in deployment.processes if p.name == name)
        if old.popen.poll() is None:
            raise ValueError(f"{name} is still running")
        args = [*deployment._worker_args(name.rsplit("-", 1)[0]), *extra_args]
        args[args.index("--port") + 1] = str(old.port)
        env = {**deployment.env, **(extra_env or {})}
        started.append((old, _spawn(name, args, deployment.log_dir, env)))
    for old, proc in started:
        proc.wait_ready(READY_TIMEOUT_S)
        for where in (deployment, *views):
            where.processes[:] = [proc if p is old else p for p in where.processes]
    procs = [proc for _, proc in started]
    if not extra_args:
        for where in (deployment, *views):
            _until_router_takes(where, procs)
    return procs


def rank_pids(deployment: Deployment, proc: Process) -> list[int]:
    """The pids of a split worker's ranks 1..N-1, as its log names them (the suite's zygote
    forks them: they are not the worker's children)."""
    assert deployment.log_dir is not None
    lines = (deployment.log_dir / f"{proc.name}.log").read_text().splitlines()
    said = [m for line in lines if (m := _RANKS.search(line))]
    return [int(pid) for pid in said[-1].group(1).split(", ")] if said else []


_RANKS = re.compile(r"split over \d+ ranks \(rank processes: ([\d, ]+)\)")


def _until_router_takes(deployment: Deployment, workers: list[Process]) -> None:
    """Until the deployment's router, if it serves metrics, counts `workers` healthy (a router
    that refused a worker restarted with another layout takes it back at its next stats
    refresh, not when a request arrives)."""
    router = next((p for p in deployment.processes if _is_router(p)), None)
    if router is None or not router.metrics_port:
        return
    from tests.e2e.test_metrics import scrape, value

    def takes_them() -> bool:
        samples = scrape(router.metrics_port)
        return all(value(samples, "kvferry_router_worker_healthy", worker=p.address,
                         role=p.name.rsplit("-", 1)[0]) == 1 for p in workers)

    until_sync(takes_them, f"{router.name} counts {[p.name for p in workers]} healthy")


def until_router_takes(deployment: Deployment, names: list[str]) -> None:
    """Until the deployment's router counts workers `names` healthy (`reconfigured` does not
    wait for it: its flags may give a worker a layout the router refuses)."""
    _until_router_takes(deployment, [p for p in deployment.processes if p.name in names])


@contextmanager
def reconfigured(deployment: Deployment, names: list[str], extra_args: list[str],
                 extra_env: dict[str, str] | None = None, restore: bool = True
                 ) -> Iterator[list[Process]]:
    """Workers `names` of `deployment` restarted with `extra_args` after their own flags
    (and `extra_env` in their environment), at their addresses, for the duration; then, if
    `restore`, restarted with their own flags again (those the test stopped or killed too).
    A test that needs a worker flag the shared deployment lacks pays a worker restart, not a
    deployment start."""
    _stop_named(deployment, names)
    try:
        yield _respawn(names, deployment, (), tuple(extra_args), extra_env)
    finally:
        if restore:
            restart(deployment, names)


@contextmanager
def restarted_in_turn(deployment: Deployment, names: list[str]
                      ) -> Iterator[Callable[[list[str]], list[Process]]]:
    """`reconfigured` for several sets of flags in turn: each call of what this yields
    restarts workers `names` with those flags after their own; at the end they are restarted
    with their own flags once (not after each set, as nested `reconfigured` would)."""

    def restart_with(extra_args: list[str]) -> list[Process]:
        _stop_named(deployment, names)
        return _respawn(names, deployment, (), tuple(extra_args))

    try:
        yield restart_with
    finally:
        restart(deployment, names)


def restart(deployment: Deployment, names: list[str]) -> list[Process]:
    """Workers `names` of `deployment` stopped (if running) and started again with their own
    flags, at their addresses."""
    _stop_named(deployment, names)
    return _respawn(names, deployment, (), ())


def _stop_named(deployment: Deployment, names: list[str]) -> None:
    for name in names:
        _stop(next(p for p in deployment.processes if p.name == name))


async def kill_busy_decode(deployment: Deployment) -> Process:
    """kill -9 the decode worker holding a running request (`busy_process`) and wait for it
    to be gone; the killed process, for the caller to `respawn`."""
    victim = await asyncio.to_thread(busy_process, deployment, "decode")
    assert victim is not None
    os.kill(victim.popen.pid, signal.SIGKILL)
    await asyncio.to_thread(victim.popen.wait, 10)
    return victim


def kill_decode_mid_stream(deployment: Deployment, request: generation_pb2.GenerateRequest,
                           after_tokens: int) -> tuple[client.Completion, Process]:
    """Stream `request` through the deployment's router; once `after_tokens` tokens arrived,
    kill -9 the decode worker holding a running request (`busy_process`). The completed
    stream (the router migrates the request) and the killed process, for the caller to
    `respawn`."""
    async def run() -> tuple[client.Completion, Process]:
        async with grpc_util.channel(deployment.router_address) as chan:
            stub = generation_pb2_grpc.GenerationServiceStub(chan)
            completion, victim = client.Completion(), None
            async for _, latest in client.stream(stub, request, timeout_s=120):
                completion = latest
                if victim is None and len(completion.token_ids) >= after_tokens:
                    victim = await kill_busy_decode(deployment)
            assert victim is not None
            return completion, victim

    return asyncio.run(run())


def start_serve(argv: list[str], stderr: object) -> tuple[subprocess.Popen, str]:
    """`kvferry serve ARGV` as a user starts it: in a fresh interpreter (not forked by the
    run's zygote), every process logging to `stderr`; once it says it serves, the process
    and the router's address (its stdout is left at the next line)."""
    serve = subprocess.Popen([sys.executable, "-m", "deploy.cli", "serve", *argv],
                             stdout=subprocess.PIPE, stderr=stderr, text=True,
                             env={**os.environ, zygote.ZYGOTE_ENV: "off"})
    assert serve.stdout is not None
    line = serve.stdout.readline()
    if "serving on" not in line:  # not left running behind the failure
        serve.send_signal(signal.SIGTERM)
        serve.wait(60)
        raise AssertionError(f"serve did not say it serves: {line!r}")
    return serve, line.split("serving on ")[1].split()[0]
