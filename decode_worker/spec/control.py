"""How many drafts each sequence verifies: k adapted to its acceptance and to what extra rows
cost on this worker (docs/spec-decode-design.md 3.7).

Per sequence, alpha is an exponentially weighted mean (weight ALPHA_WEIGHT) of accepted over
drafted tokens, over its steps with drafts. With k drafts a verification yields on average
E(k) = (1 - alpha^(k+1)) / (1 - alpha) tokens (drafts accepted in order, then one more), at a
cost of c(k) = t(R + k) / t(R) of a plain step, R being the batch's rows and t the worker's
step time by rows: a line fitted to the steps it ran (recent steps weigh most). k maximises
E(k) / c(k) over [0, K]. When 0 wins, the sequence pauses PAUSE_STEPS steps (doubling each
time it happens again, up to MAX_PAUSE_STEPS), then probes with one draft, which updates
alpha. Outputs never depend on k (rejection sampling keeps exactly what sequential decoding
yields), so timing may drive it.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

ALPHA_WEIGHT = 0.3  # weight of a step's acceptance in the running mean
INITIAL_ALPHA = 0.5  # before a sequence's first verification
PAUSE_STEPS = 8
MAX_PAUSE_STEPS = 128
STEP_FIT_DECAY = 0.98  # per step: the weight of older steps in the step-time line
# No row is free: a draft costs at least this fraction of a one-sequence step (its proposal,
# its sampling, its K/V write), whatever the fitted line says.
MIN_ROW_COST = 0.02


@dataclass
class _SeqState:
    alpha: float = INITIAL_ALPHA
    pause_left: int = 0  # steps still paused
    next_pause: int = PAUSE_STEPS  # length of its next pause
    is_probing: bool = False  # the next verification is a probe after a pause


class StepTimes:
    """A step's seconds as a line in its rows, a + b x rows, by weighted least squares over
    the steps seen (each older step's weight decays by STEP_FIT_DECAY)."""

    def __init__(self) -> None:
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def observe(self, rows: int, seconds: float) -> None:
        d = STEP_FIT_DECAY
        self._w = self._w * d + 1.0
        self._x = self._x * d + rows
        self._y = self._y * d + seconds
        self._xx = self._xx * d + rows * rows
        self._xy = self._xy * d + rows * seconds

    def cost(self, rows: int, extra: int) -> float:
        """t(rows + extra) / t(rows), at least 1 + MIN_ROW_COST x extra / rows (the floor
        alone until two row counts were seen)."""
        floor = 1.0 + MIN_ROW_COST * extra / rows
        var = self._xx * self._w - self._x * self._x
        if self._w == 0.0 or var <= 1e-9 * self._w * self._w:  # no slope yet
            return floor
        slope = max(0.0, (self._xy * self._w - self._x * self._y) / var)
        base = (self._y - slope * self._x) / self._w + slope * rows
        if base <= 0.0:
            return floor
        return max(floor, (base + slope * extra) / base)


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a verification of k drafts yields when each is accepted with probability alpha
    (given the ones before it were)."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


class SpecController:
    """Per-sequence draft counts for one step loop (executor thread only)."""

    def __init__(self, max_k: int, is_adaptive: bool = True) -> None:
        self.max_k = max_k
        self.is_adaptive = is_adaptive
        self.times = StepTimes()
        self._seqs: dict[Hashable, _SeqState] = {}

    @property
    def num_paused(self) -> int:
        return sum(1 for s in list(self._seqs.values()) if s.pause_left > 0)

    def k_for(self, key: Hashable, batch_rows: int) -> int:
        """Drafts the sequence `key` should verify in a step of `batch_rows` sequences (0: none;
        its proposer is not asked). Counts one step of a pause."""
        if not self.is_adaptive:
            return self.max_k
        state = self._seqs.setdefault(key, _SeqState())
        if state.pause_left > 0:
            state.pause_left -= 1
            if state.pause_left == 0:
                state.is_probing = True
            return 0
        if state.is_probing:
            return 1
        best_k, best = 0, 1.0  # k = 0: one token at the cost of a plain step
        for k in range(1, self.max_k + 1):
            gain = expected_tokens(state.alpha, k) / self.times.cost(batch_rows, k)
            if gain > best:
                best_k, best = k, gain
        if best_k == 0:  # this step is the pause's first
            state.pause_left = state.next_pause - 1
            state.next_pause = min(2 * state.next_pause, MAX_PAUSE_STEPS)
        return best_k

    def observe(self, key: Hashable, drafted: int, accepted: int) -> None:
        """A verification of `drafted` drafts (> 0) accepted `accepted` of them."""
        state = self._seqs.setdefault(key, _SeqState())
        rate = accepted / drafted
        state.alpha = (1 - ALPHA_WEIGHT) * state.alpha + ALPHA_WEIGHT * rate
        if state.is_probing:
            state.is_probing = False
            if rate > 0:  # the probe found drafts worth verifying again: pauses restart short
                state.next_pause = PAUSE_STEPS

    def forget(self, key: Hashable) -> None:
        self._seqs.pop(key, None)
