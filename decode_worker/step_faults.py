"""Fault injection into the decode step loop, for tests: KVFERRY_FAULT_DECODE_STEPS lists step
numbers (counted from 1) whose forward raises, as "3,7", or "3-" for every step from the
third on; KVFERRY_FAULT_DECODE_STEP_DELAY_S makes every step that long slower (a slow worker,
so tests can order events without racing the machine's speed)."""

from __future__ import annotations

from collections.abc import Callable

FAULT_ENV = "KVFERRY_FAULT_DECODE_STEPS"
DELAY_ENV = "KVFERRY_FAULT_DECODE_STEP_DELAY_S"


class InjectedFault(RuntimeError):
    """Raised by a step named in KVFERRY_FAULT_DECODE_STEPS."""


def fault_steps(spec: str) -> Callable[[int], bool]:
    """KVFERRY_FAULT_DECODE_STEPS ("3,7" or "3-") as a predicate on step numbers."""
    if not spec:
        return lambda step: False
    if spec.endswith("-"):
        first = int(spec[:-1])
        return lambda step: step >= first
    steps = {int(x) for x in spec.split(",")}
    return lambda step: step in steps
