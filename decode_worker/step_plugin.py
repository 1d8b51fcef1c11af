"""The decode step's fixed points, and the interface of the features called at them.

One step of the loop (decode_worker/steps.py) is: bound and grow every running sequence's
table (event loop), then, per forward (executor thread), plan the rows, run the forward,
keep the tokens. Speculation (decode_worker/spec/), K/V eviction (decode_worker/evict/) and
fault injection (decode_worker/step_faults.py) are `StepPlugin`s: the loop calls each at
those points, in the order it holds them, and knows nothing else of them. Every point is a
no-op here; a feature overrides the ones it needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from decode_worker.sequence import DecodeSeq
    from decode_worker.step_rows import StepRows


class StepPlugin:
    """A feature of the decode step (see the module docstring)."""

    def before_grow(self, running: Sequence[DecodeSeq]) -> None:
        """Event loop, before each running sequence gets the slot its next step writes:
        give K/V back (eviction bounds a table; speculation trims rejected drafts' blocks)."""

    def after_grow(self, running: Sequence[DecodeSeq]) -> None:
        """Event loop, once every running sequence has its slot: take more slots from blocks
        nobody holds (the allocator's truly free ones), never preempting or evicting."""

    def needs_loop(self, batch: Sequence[DecodeSeq]) -> bool:
        """Executor thread, between two steps of a stable batch: whether the event loop must
        see the batch before its next step (its `before_grow` or `after_grow` has work)."""
        return False

    def plan(self, rows: StepRows) -> None:
        """Executor thread, before the forward: add to the step's rows (drafts, a buffer of
        attention mass), or fail or slow the step."""

    def done(self, rows: StepRows, kept: Sequence[list[int]]) -> None:
        """Executor thread, after the forward: each sequence of `rows.batch` keeps `kept`
        (not yet appended to its tokens)."""

    def forget(self, seq: DecodeSeq) -> None:
        """Event loop: `seq` left the step loop."""

    def moved(self, seq: DecodeSeq) -> None:
        """Event loop: `seq`'s blocks changed under it (swapped back in)."""
