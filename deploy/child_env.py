"""The environment kvferry hands the processes it starts: what only the router reads stays
with the router.

The router alone checks API keys (`$KVFERRY_API_KEY`, router/identity.py). Workers, their
tensor-parallel ranks (which inherit the worker's environment), the tests' zygote that forks
servers, the K/V store's server and the processes of a local Ray instance are started without
it, so none of them can hand a key on: not through /proc/PID/environ, a crash report, a
library that logs its environment, or a child of its own.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

ROUTER_SECRETS = ("KVFERRY_API_KEY",)  # deploy.security_args.API_KEY_ENV


def is_router(name: str) -> bool:
    """Whether the component `name` is a router: "router", or "router-<what>" (a second
    router in front of a deployment's workers)."""
    return name == "router" or name.startswith("router-")


def without_router_secrets(env: Mapping[str, str]) -> dict[str, str]:
    """`env` for a process that is not a router."""
    return {name: value for name, value in env.items() if name not in ROUTER_SECRETS}


@contextmanager
def router_secrets_hidden() -> Iterator[None]:
    """This process's environment without the router's secrets while it lasts, for a library
    that starts long-lived processes with a copy of it (a local Ray instance)."""
    hidden = {name: os.environ.pop(name) for name in ROUTER_SECRETS if name in os.environ}
    try:
        yield
    finally:
        os.environ.update(hidden)
