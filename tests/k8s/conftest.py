"""Every kustomize tree rendered once per session, and every kvferry container's command line
parsed by the real CLI parser."""

from __future__ import annotations

import argparse
import contextlib
import io

import pytest
from k8s_manifests import TREES, VAR_REF, Container, config_maps, containers, expand, render

from deploy.args import build_parser


@pytest.fixture(scope="session")
def rendered() -> dict[str, list[dict]]:
    return {tree: render(tree) for tree in TREES}


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def service_names(command: str) -> list[str]:
    if command in ("router", "serve"):  # serve's entry point is its router
        from router.server import SERVICE_NAMES
    elif command == "prefill-worker":
        from prefill_worker.server import SERVICE_NAMES
    else:
        from decode_worker.server import SERVICE_NAMES
    return list(SERVICE_NAMES)


class Parsed:
    """One container's kvferry command line, parsed by the real CLI parser."""

    def __init__(self, container: Container, env: dict[str, str | None]) -> None:
        argv = container.argv()
        assert argv is not None
        self.argv = expand(argv, env)
        unresolved = [a for a in self.argv if VAR_REF.search(a)]
        assert unresolved == [], f"{container.name}: no literal value for {unresolved}"
        self.command = next(a for a in self.argv if not a.startswith("-")
                            and a in subcommands())
        stderr = io.StringIO()
        try:
            with contextlib.redirect_stderr(stderr):
                self.args = build_parser().parse_args(self.argv)
        except SystemExit:
            pytest.fail(f"{container.name}: kvferry rejects {self.argv}:\n{stderr.getvalue()}")

    def value(self, flag: str) -> object:
        """A flag's parsed value (None when the subcommand has no such flag)."""
        return getattr(self.args, flag.lstrip("-").replace("-", "_"), None)


def kvferry_containers(tree: str, resources: list[dict]) -> list[tuple[Container, Parsed]]:
    maps = config_maps(resources)
    found = []
    for container in containers(tree, resources):
        if container.argv() is not None:
            found.append((container, Parsed(container, container.env_names(maps))))
    return found


@pytest.fixture(scope="session")
def parsed(rendered: dict[str, list[dict]]) -> dict[str, list[tuple[Container, Parsed]]]:
    return {tree: kvferry_containers(tree, rendered[tree]) for tree in TREES}


def selects(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())
