"""Which deployments and servers a run started: a diagnostic the test suite counts with."""

from __future__ import annotations

import os

# Diagnostics: when set, every deployment start appends one line to this file, from whichever
# process starts it (the test suite counts the deployments it starts: tests/conftest.py).
START_LOG_ENV = "KVFERRY_START_LOG"


def record_start(kind: str, shape: str) -> None:
    """One line `<kind> <shape>\t<test>` in $KVFERRY_START_LOG, when set (an O_APPEND write of
    one short line: whole even when processes write at once); <test> is the pytest test that
    was running, inherited through the environment, or empty."""
    path = os.environ.get(START_LOG_ENV)
    if path:
        test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
        with open(path, "a") as log_file:
            log_file.write(f"{kind} {shape}\t{test}\n")
