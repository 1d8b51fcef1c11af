"""What a benchmark talks to: a running router, or a deployment the benchmark launches.

Target strings (command line): `HOST:PORT`, `NAME=HOST:PORT`, `launch:disagg`,
`launch:colocated`, `NAME=launch:KIND`. Launched deployments start when their turn comes and
stop right after it, so two of them never compete for the machine.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from deploy.launcher import Deployment

LAUNCH_KINDS = ("disagg", "colocated")


@dataclass(frozen=True)
class LaunchOptions:
    """How `launch:` targets are started (deploy.launcher.Deployment's arguments)."""

    model: str | None = None  # None: the default seeded model, made if missing
    num_prefill: int = 1
    num_decode: int = 1
    block_size: int = 16
    kv_pool_size: str = "256MiB"
    torch_threads: int = 1
    attention_backend: str = "auto"
    worker_args: tuple[str, ...] = ()
    router_args: tuple[str, ...] = ()
    log_dir: Path | None = None


@dataclass(frozen=True)
class Target:
    """Exactly one of: address (a running router), launch (a kind to start with
    LaunchOptions), deployment (a Deployment, not yet started, that the benchmark starts and
    stops: for scripts that need their own worker flags)."""

    name: str
    address: str | None = None
    launch: str | None = None
    deployment: Deployment | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        given = [x for x in (self.address, self.launch, self.deployment) if x is not None]
        if len(given) != 1:
            raise ValueError(f"target {self.name!r}: give exactly one of address, launch, "
                             "deployment")
        if self.launch is not None and self.launch not in LAUNCH_KINDS:
            raise ValueError(f"target {self.name!r}: launch must be one of {LAUNCH_KINDS}, "
                             f"got {self.launch!r}")


def parse_target(text: str) -> Target:
    """`[NAME=]HOST:PORT` or `[NAME=]launch:KIND`; the name defaults to the rest."""
    name, sep, spec = text.partition("=")
    if not sep:
        name, spec = text, text
    if not name or not spec:
        raise ValueError(f"target: expected [NAME=]HOST:PORT or [NAME=]launch:KIND, got {text!r}")
    if spec.startswith("launch:"):
        kind = spec.removeprefix("launch:")
        return Target(name=name if sep else kind, launch=kind)
    host, colon, port = spec.rpartition(":")
    if not colon or not host or not port.isdigit():
        raise ValueError(f"target: expected HOST:PORT, got {spec!r}")
    return Target(name=name, address=spec)


def _default_model() -> str:
    from kvferry.model.checkpoint import make_model
    from kvferry.settings import DEFAULT_MODEL_DIR

    if not (DEFAULT_MODEL_DIR / "config.json").exists():
        make_model(DEFAULT_MODEL_DIR)
    return str(DEFAULT_MODEL_DIR)


def make_deployment(kind: str, options: LaunchOptions) -> Deployment:
    log_dir = options.log_dir / kind if options.log_dir else None
    if log_dir:
        log_dir.mkdir(parents=True, exist_ok=True)
    return Deployment(
        model=options.model or _default_model(), num_prefill=options.num_prefill,
        num_decode=options.num_decode, block_size=options.block_size,
        kv_pool_size=options.kv_pool_size, torch_threads=options.torch_threads,
        attention_backend=options.attention_backend, is_colocated=kind == "colocated",
        worker_args=list(options.worker_args), router_args=list(options.router_args),
        log_dir=log_dir,
    )


@contextmanager
def open_target(target: Target, options: LaunchOptions = LaunchOptions()) -> Iterator[str]:
    """The router address to benchmark; a launched deployment lives until the block ends."""
    if target.address is not None:
        yield target.address
        return
    deployment = target.deployment or make_deployment(str(target.launch), options)
    with deployment:
        yield deployment.router_address
