"""What a benchmark talks to, and over which backend: a running server, or a deployment the
benchmark launches.

Target strings (command line): `[NAME=][BACKEND:]WHERE`, BACKEND one of grpc, openai-chat,
openai-completions (default: --backend), WHERE one of `HOST:PORT` (kvferry's gRPC router; for
an OpenAI backend, http://HOST:PORT/v1), an OpenAI base URL `http(s)://HOST:PORT[/PATH]`, or
`launch:disagg` / `launch:colocated`. A launched deployment serves its HTTP front too when
the backend is an OpenAI one. Launched deployments start when their turn comes and stop right
after it, so two of them never compete for the machine.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from deploy.default_model import tiny_model
from deploy.launcher import Deployment
from deploy.loadgen.openai_client import BACKENDS, OPENAI_BACKENDS
from deploy.placement import beside_router, client_placement

LAUNCH_KINDS = ("disagg", "colocated")


@dataclass(frozen=True)
class Target:
    """Exactly one of: address (a running kvferry router's gRPC front), base_url (a running
    OpenAI-compatible server), launch (a kind to start from the benchmark's template
    Deployment), deployment (a Deployment, not yet started, that the benchmark starts and
    stops: for scripts that need their own worker flags). `backend` says how to talk to it."""

    name: str
    address: str | None = None
    launch: str | None = None
    deployment: Deployment | None = field(default=None, compare=False)
    backend: str = "grpc"
    base_url: str | None = None

    def __post_init__(self) -> None:
        given = [x for x in (self.address, self.base_url, self.launch, self.deployment)
                 if x is not None]
        if len(given) != 1:
            raise ValueError(f"target {self.name!r}: give exactly one of address, base_url, "
                             "launch, deployment")
        if self.launch is not None and self.launch not in LAUNCH_KINDS:
            raise ValueError(f"target {self.name!r}: launch must be one of {LAUNCH_KINDS}, "
                             f"got {self.launch!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"target {self.name!r}: backend must be one of {BACKENDS}, "
                             f"got {self.backend!r}")
        if self.address is not None and self.backend != "grpc":
            raise ValueError(f"target {self.name!r}: {self.backend} needs a base_url")
        if self.base_url is not None and self.backend == "grpc":
            raise ValueError(f"target {self.name!r}: a base_url needs an OpenAI backend "
                             f"({', '.join(OPENAI_BACKENDS)})")


class Endpoint(NamedTuple):
    """Where an opened target answers: its gRPC front and its OpenAI base URL, as known."""

    grpc_address: str | None
    base_url: str | None
    # Where its processes and this client ran: name -> core list ("router" and "client"
    # included); a target not launched here: the client's only
    placement: dict[str, str] | None = None


def _split_backend(spec: str, default: str) -> tuple[str, str]:
    """(backend, WHERE) of "[BACKEND:]WHERE"."""
    for backend in BACKENDS:
        if spec.startswith(backend + ":"):
            return backend, spec.removeprefix(backend + ":")
    return default, spec


def parse_target(text: str, backend: str = "grpc") -> Target:
    """`[NAME=][BACKEND:]WHERE` (module docstring); the name defaults to what follows it, a
    launched kind's to the kind (with the backend when not gRPC)."""
    name, sep, spec = text.partition("=")
    if not sep:
        name, spec = text, text
    backend, where = _split_backend(spec, backend)
    if not name or not where:
        raise ValueError(f"target: expected [NAME=][BACKEND:]HOST:PORT|URL|launch:KIND, "
                         f"got {text!r}")
    if where.startswith("launch:"):
        kind = where.removeprefix("launch:")
        default_name = kind if backend == "grpc" else f"{kind}-{backend}"
        return Target(name=name if sep else default_name, launch=kind, backend=backend)
    if where.startswith(("http://", "https://")):
        if backend == "grpc":
            raise ValueError(f"target {text!r}: a URL is an OpenAI server: write "
                             f"openai-chat:URL or openai-completions:URL")
        return Target(name=name, base_url=where, backend=backend)
    host, colon, port = where.rpartition(":")
    if not colon or not host or not port.isdigit():
        raise ValueError(f"target: expected HOST:PORT, got {where!r}")
    if backend != "grpc":
        return Target(name=name, base_url=f"http://{where}/v1", backend=backend)
    return Target(name=name, address=where)


def make_deployment(kind: str, template: Deployment, http: bool = False) -> Deployment:
    """A fresh, not started copy of `template` shaped as `kind`; logs go to LOG_DIR/KIND.
    A template without a model launches the tiny one: the documented figures are for it.
    `http`: the router also serves its OpenAI HTTP front (on a free port)."""
    log_dir = template.log_dir / kind if template.log_dir else None
    if log_dir:
        log_dir.mkdir(parents=True, exist_ok=True)
    deployment = replace(template, model=template.model or tiny_model(),
                         is_colocated=kind == "colocated", log_dir=log_dir, processes=[],
                         network=None)
    if http:
        deployment = replace(deployment, http_port=0)
    return deployment


def _endpoint(deployment: Deployment, backend: str) -> Endpoint:
    if backend == "grpc":
        return Endpoint(deployment.router_address, None)
    return Endpoint(deployment.router_address, f"http://{deployment.http_address}/v1")


@contextmanager
def open_target(target: Target, launch: Deployment | None = None) -> Iterator[Endpoint]:
    """Where to send the benchmark; a launched deployment lives until the block ends.
    `launch`: the template of `launch:` targets (default: Deployment())."""
    if target.address is not None or target.base_url is not None:
        yield Endpoint(target.address, target.base_url, client_placement())
        return
    deployment = target.deployment or make_deployment(
        str(target.launch), launch or Deployment(), http=target.backend != "grpc")
    with deployment, beside_router(deployment.core_plan) as placement:
        yield _endpoint(deployment, target.backend)._replace(placement=placement)
