"""K/V eviction as a plug-in of the decode step (decode_worker/step_plugin.py): each running
sequence bounded to its sink and window blocks before its slots are given, and, with H2O,
every step's attention mass handed to the policy. The policies themselves
(kvferry/model/eviction.py) are shared with the prefill batcher, which bounds a prompt the
same way while it is prefilled."""

from __future__ import annotations

from collections.abc import Sequence

from decode_worker.sequence import DecodeSeq
from decode_worker.step_plugin import StepPlugin
from decode_worker.step_rows import StepRows
from kvferry.model.eviction import StreamingEviction


class EvictionStep(StepPlugin):
    def __init__(self, policy: StreamingEviction) -> None:
        self.policy = policy

    def before_grow(self, running: Sequence[DecodeSeq]) -> None:
        for seq in running:
            self.policy.bound(seq)

    def needs_loop(self, batch: Sequence[DecodeSeq]) -> bool:
        """A sequence must give up K/V (or re-base) before its next step."""
        return any(self.policy.needs(s) for s in batch)

    def plan(self, rows: StepRows) -> None:
        rows.wants_mass = self.policy.wants_mass

    def done(self, rows: StepRows, kept: Sequence[list[int]]) -> None:
        if rows.mass is not None:
            self.policy.observe(rows.batch, rows.mass)

    def forget(self, seq: DecodeSeq) -> None:
        self.policy.forget(seq.key)
