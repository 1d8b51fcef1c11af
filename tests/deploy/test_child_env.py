"""The router's secrets stay with the router (deploy/child_env.py): workers (and so their
tensor-parallel ranks), the zygote that forks servers, the K/V store's server and a local Ray
instance are started without $KVFERRY_API_KEY, while the router still enforces it."""

from __future__ import annotations

import asyncio
import io
import subprocess
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest

from deploy import child_env, client, ray_launcher, spawn, store_server, zygote
from deploy.launcher import Deployment
from deploy.security_args import API_KEY_ENV
from deploy.store_server import StoreServer
from kvferry.rpc import security

KEY = "router-only-key-0123456789abcdef"


def _environ(pid: int) -> dict[str, str]:
    """A process's environment as the kernel shows it to its user."""
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(entry.split("=", 1) for entry in raw.decode(errors="replace").split("\0")
                if "=" in entry)


def test_the_api_key_is_a_router_secret() -> None:
    assert API_KEY_ENV in child_env.ROUTER_SECRETS
    env = {API_KEY_ENV: KEY, "PATH": "/bin"}
    assert child_env.without_router_secrets(env) == {"PATH": "/bin"}
    assert [child_env.is_router(n) for n in ("router", "router-tenants", "decode-0",
                                             "prefill-1", "colocated-0")] == [
        True, True, False, False, False]


def test_spawn_hands_the_key_to_routers_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the zygote and through a fresh interpreter alike."""
    handed: list[tuple[str, dict[str, str]]] = []

    def forked(args: list[str], env: dict[str, str], stderr: object) -> None:
        handed.append(("zygote", env))  # then the caller starts an interpreter itself

    def popen(argv: list[str], **kwargs: object) -> SimpleNamespace:
        handed.append(("popen", kwargs["env"]))  # type: ignore[arg-type]
        return SimpleNamespace(stdout=io.StringIO(""), poll=lambda: 0)

    monkeypatch.setenv(API_KEY_ENV, KEY)
    monkeypatch.setattr(zygote, "spawn", forked)
    monkeypatch.setattr(spawn.subprocess, "Popen", popen)
    for name in ("decode-0", "prefill-0", "colocated-0", "router", "router-keys"):
        handed.clear()
        spawn._spawn(name, ["--version"], None, {API_KEY_ENV: KEY})
        assert [how for how, _ in handed] == ["zygote", "popen"]
        assert all((env.get(API_KEY_ENV) == KEY) == child_env.is_router(name)
                   for _, env in handed), name


def test_the_zygote_and_the_store_server_start_without_the_key(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A forked server's /proc/PID/environ is the zygote's own: it must not hold the key."""
    monkeypatch.setenv(API_KEY_ENV, KEY)
    monkeypatch.delenv(zygote.ZYGOTE_ENV, raising=False)  # restored after the test
    started = zygote.start()
    assert started is not None
    try:
        env = _environ(started.pid)
        assert API_KEY_ENV not in env and "PATH" in env
    finally:
        assert started.stdin is not None
        started.stdin.close()  # the zygote exits when its starter's pipe closes
        started.wait(30)
    # valkey-server writes its title over its environment's memory, so /proc shows nothing of
    # it: what it is handed is checked instead
    handed: list[dict[str, str]] = []
    real_popen = subprocess.Popen

    def popen(*args: object, **kwargs: object) -> subprocess.Popen[bytes]:
        handed.append(kwargs["env"])  # type: ignore[arg-type]
        return real_popen(*args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(store_server.subprocess, "Popen", popen)
    store = StoreServer(tmp_path / "store", 1 << 20).start()
    store.stop()
    assert len(handed) == 1 and API_KEY_ENV not in handed[0] and "PATH" in handed[0]


def test_a_local_ray_instance_starts_without_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray's processes copy the environment of ray.init's caller; the router actor is handed
    its keys in its settings, parsed in the driver."""
    seen: list[str | None] = []
    monkeypatch.setenv(API_KEY_ENV, KEY)
    monkeypatch.setattr(ray_launcher.ray, "init", lambda **_: seen.append(
        ray_launcher.os.environ.get(API_KEY_ENV)))
    ray_launcher.start_local_ray(namespace="x")
    assert seen == [None]
    assert ray_launcher.os.environ[API_KEY_ENV] == KEY  # the driver's own is back


@pytest.mark.slow
def test_a_keyed_deployment_keeps_the_key_in_its_router(qwen3_checkpoint: Path,
                                                        tmp_path: Path) -> None:
    """Fresh interpreters (no zygote), so /proc/PID/environ is each process's environment:
    the worker's lacks the key, the router's has it and refuses a call without it."""
    deployment = Deployment(model=str(qwen3_checkpoint), is_colocated=True, num_decode=1,
                            log_dir=tmp_path, env={API_KEY_ENV: KEY, zygote.ZYGOTE_ENV: "off"})
    deployment.start()
    try:
        pids = {p.name: p.popen.pid for p in deployment.processes}
        assert isinstance(deployment.processes[0].popen, subprocess.Popen)
        assert set(pids) == {"colocated-0", "router"}
        assert API_KEY_ENV not in _environ(pids["colocated-0"])
        assert _environ(pids["router"])[API_KEY_ENV] == KEY

        async def info(key: str | None) -> grpc.StatusCode:
            creds = security.PLAINTEXT._replace(token=key)
            async with security.channel(deployment.router_address, creds) as chan:
                try:
                    await client.model_info(chan)
                except grpc.aio.AioRpcError as exc:
                    return exc.code()
            return grpc.StatusCode.OK

        assert asyncio.run(info(None)) == grpc.StatusCode.UNAUTHENTICATED
        assert asyncio.run(info(KEY)) == grpc.StatusCode.OK
    finally:
        deployment.stop()
