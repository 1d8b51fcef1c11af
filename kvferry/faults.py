"""Fault injection for tests: faults armed for a whole process, or for single requests.

For a whole process, by environment variables read when a worker starts (every request):
KVFERRY_FAULT_PUSH_CHUNK_DELAY_S, KVFERRY_FAULT_PUSH_DONE_DELAY_S, KVFERRY_FAULT_CORRUPT_PUSHES,
KVFERRY_FAULT_BREAK_PUSHES, KVFERRY_FAULT_NIXL_READ_DELAY_S, KVFERRY_FAULT_PREFILL_BATCH_DELAY_S,
KVFERRY_FAULT_DECODE_STEP_DELAY_S, KVFERRY_FAULT_DECODE_STEPS, KVFERRY_FAULT_DISK_FULL_AFTER_BYTES
and KVFERRY_FAULT_TIER_WRITE_DELAY_S (one per field of `Faults`).

For one request, only in a process started with KVFERRY_FAULTS=per-request: the request's id
carries `!<field>=<value>` tags, e.g. `t7!push_chunk_delay_s=0.4!corrupt_pushes=1`, which
arm those faults for that request alone, so one shared test deployment serves clean and
faulty requests side by side (`tag()` writes them). Without that variable no id is ever read
for faults: a client cannot slow or break a production worker.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

FAULTS_ENV = "KVFERRY_FAULTS"
PER_REQUEST = "per-request"
ENV_PREFIX = "KVFERRY_FAULT_"
_TAG = re.compile(r"!([a-z_]+)=([0-9.,-]+)")


class InjectedFault(RuntimeError):
    """Raised where a fault says a step fails (decode_steps)."""


@dataclass(frozen=True, slots=True)
class Faults:
    """What to break or slow down; the zero value breaks nothing."""

    push_chunk_delay_s: float = 0.0  # prefill: sleep before each K/V chunk but the first
    push_done_delay_s: float = 0.0  # prefill: hold a push's done after the receiver took it
    corrupt_pushes: int = 0  # prefill: flip a byte in the first N pushes, after the checksum
    # prefill (gRPC, NIXL): the first N pushes of a request fail as over a cut link (UNAVAILABLE),
    # counted by each prefill worker over that request id's pushes
    break_pushes: int = 0
    nixl_read_delay_s: float = 0.0  # decode: sleep before each NIXL read of the K/V
    prefill_batch_delay_s: float = 0.0  # prefill: each forward batch holding the request waits
    decode_step_delay_s: float = 0.0  # decode: each step (holding the request) that much slower
    decode_steps: str = ""  # decode: steps whose forward raises, from 1: "3,7" or "3-"
    disk_full_after_bytes: int = 0  # disk tier: writes fail with ENOSPC past this many bytes
    tier_write_delay_s: float = 0.0  # disk tier: pause between a block's bytes and its rename

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> Faults:
        """The process-wide faults: KVFERRY_FAULT_<FIELD> for each field."""
        return cls(**{f.name: _parse(f, env[ENV_PREFIX + f.name.upper()])
                      for f in dataclasses.fields(cls) if ENV_PREFIX + f.name.upper() in env})

    def for_request(self, request_id: str) -> Faults:
        """These faults with the id's tags on top, when per-request faults are on."""
        if os.environ.get(FAULTS_ENV) != PER_REQUEST or "!" not in request_id:
            return self
        known = {f.name: f for f in dataclasses.fields(self)}
        tags = {name: _parse(known[name], value)
                for name, value in _TAG.findall(request_id) if name in known}
        return dataclasses.replace(self, **tags) if tags else self


def _parse(field: dataclasses.Field, value: str) -> float | int | str:
    kind = {"float": float, "int": int}.get(str(field.type), str)
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"{ENV_PREFIX}{field.name.upper()}: {value!r} is not a {kind.__name__}"
                         ) from None


def tag(**faults: float | int | str) -> str:
    """The id suffix that arms `faults` for one request: tag(corrupt_pushes=1)."""
    known = {f.name for f in dataclasses.fields(Faults)}
    unknown = set(faults) - known
    if unknown:
        raise ValueError(f"unknown faults {sorted(unknown)}; known: {sorted(known)}")
    return "".join(f"!{name}={value}" for name, value in faults.items())


def step_numbers(spec: str) -> Callable[[int], bool]:
    """A decode_steps spec ("3,7" or "3-", counted from 1) as a predicate on step numbers."""
    if not spec:
        return lambda step: False
    if spec.endswith("-"):
        first = int(spec[:-1])
        return lambda step: step >= first
    steps = {int(x) for x in spec.split(",")}
    return lambda step: step in steps
