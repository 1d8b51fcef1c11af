"""What a benchmark talks to: a running router, or a deployment the benchmark launches.

Target strings (command line): `HOST:PORT`, `NAME=HOST:PORT`, `launch:disagg`,
`launch:colocated`, `NAME=launch:KIND`. Launched deployments start when their turn comes and
stop right after it, so two of them never compete for the machine.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

from deploy.default_model import tiny_model
from deploy.launcher import Deployment

LAUNCH_KINDS = ("disagg", "colocated")


@dataclass(frozen=True)
class Target:
    """Exactly one of: address (a running router), launch (a kind to start from the
    benchmark's template Deployment), deployment (a Deployment, not yet started, that the
    benchmark starts and stops: for scripts that need their own worker flags)."""

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


def make_deployment(kind: str, template: Deployment) -> Deployment:
    """A fresh, not started copy of `template` shaped as `kind`; logs go to LOG_DIR/KIND.
    A template without a model launches the tiny one: the documented figures are for it."""
    log_dir = template.log_dir / kind if template.log_dir else None
    if log_dir:
        log_dir.mkdir(parents=True, exist_ok=True)
    return replace(template, model=template.model or tiny_model(),
                   is_colocated=kind == "colocated", log_dir=log_dir, processes=[], network=None)


@contextmanager
def open_target(target: Target, launch: Deployment | None = None) -> Iterator[str]:
    """The router address to benchmark; a launched deployment lives until the block ends.
    `launch`: the template of `launch:` targets (default: Deployment())."""
    if target.address is not None:
        yield target.address
        return
    deployment = target.deployment or make_deployment(str(target.launch),
                                                      launch or Deployment())
    with deployment:
        yield deployment.router_address
