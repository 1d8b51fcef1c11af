"""Fault injection into the decode step loop, for tests (kvferry/faults.py says how faults are
armed): a step fails or slows down by the process's faults, counted over every step the
worker attempts, or by a request's own, counted over the steps that hold that request."""

from __future__ import annotations

import os
import time

from decode_worker.step_plugin import StepPlugin
from decode_worker.step_rows import StepRows
from kvferry.faults import FAULTS_ENV, PER_REQUEST, Faults, InjectedFault, step_numbers

__all__ = ["InjectedFault", "StepFaults"]


class StepFaults(StepPlugin):
    """A plug-in of the step loop (decode_worker/step_plugin.py), first at each step's start:
    `before_step` on its executor thread."""

    def __init__(self, faults: Faults) -> None:
        self.faults = faults
        self._is_faulty = step_numbers(faults.decode_steps)
        self._num_attempts = 0
        # Read once: the step loop then never looks at request ids where no id can arm faults.
        self._is_per_request = os.environ.get(FAULTS_ENV) == PER_REQUEST
        # Steps attempted holding each request armed with decode_steps (test requests only).
        self._request_attempts: dict[str, int] = {}

    def plan(self, rows: StepRows) -> None:
        delay_s = self.before_step([seq.request_id for seq in rows.batch])
        if delay_s > 0:
            time.sleep(delay_s)

    def before_step(self, request_ids: list[str]) -> float:
        """Raise InjectedFault if this step must fail; else the seconds to slow it by."""
        self._num_attempts += 1
        if self._is_faulty(self._num_attempts):
            raise InjectedFault(f"injected fault in decode step {self._num_attempts}")
        delay_s = self.faults.decode_step_delay_s
        if not self._is_per_request:
            return delay_s
        for request_id in request_ids:
            armed = self.faults.for_request(request_id)
            if armed is self.faults:
                continue
            delay_s = max(delay_s, armed.decode_step_delay_s)
            if armed.decode_steps:
                num = self._request_attempts.get(request_id, 0) + 1
                self._request_attempts[request_id] = num
                if step_numbers(armed.decode_steps)(num):
                    raise InjectedFault(f"injected fault in step {num} of {request_id}")
        return delay_s
