"""`sample_tokens` draws from the distribution its parameters define.

For fixed logits, many draws (one row per draw, a seeded stream per output index) are
compared with the exact distribution computed here in float64: softmax(logits / T), cut to
the top k and renormalised, then cut to the smallest prefix (by probability) whose mass
reaches top_p and renormalised. Tokens outside the kept set must never appear; the counts
over the kept set must pass a chi-square goodness-of-fit test with a false-alarm rate under
1e-4. The chi-square law of the statistic is asymptotic: simulating 10^6 multinomial count
vectors from each exact distribution here put the real rate at 1.0-1.4x the nominal level
(most for T = 0.7, whose rarest token expects ~11 draws), so the nominal level is 2e-5 (the
same simulation: 1.8e-5 .. 3e-5).

The seeds are fixed, so each test is deterministic. NUM_DRAWS is sized for power: with it, a
temperature applied twice (or not at all), top-k or top-p keeping one token too many or too
few, or top-p over the whole vocabulary instead of the top k, each fail with probability
> 0.9999 (the same simulation, 10^5 count vectors from each wrong distribution).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvferry.model.sampling import SamplingParams, sample_tokens

FALSE_ALARM = 2e-5  # nominal; the real rate is below 1e-4 (module docstring)
NUM_DRAWS = 6000
# 12 tokens, no ties, deliberately not sorted by token id.
LOGITS = torch.tensor([0.4, 2.0, -1.0, 1.2, -1.8, 0.7, 1.5, -0.3, 0.1, -1.5, 1.0, -0.6])


def _chi2_sf(x: float, df: int) -> float:
    """P(X > x) for X ~ chi-square(df): 1 - P(df/2, x/2), the regularized lower incomplete
    gamma by its power series (converges for every x; ~1e-15 absolute error here)."""
    a, half = df / 2, x / 2
    term = total = 1.0 / a
    n = 0
    while term > 1e-17 * total:
        n += 1
        term *= half / (a + n)
        total += term
    return 1.0 - math.exp(a * math.log(half) - half - math.lgamma(a)) * total


def _chi2_critical(df: int, alpha: float = FALSE_ALARM) -> float:
    """The x with P(X > x) = alpha, by bisection on `_chi2_sf` (decreasing in x)."""
    low, high = 0.0, 10.0 * df + 100.0
    for _ in range(100):
        mid = (low + high) / 2
        low, high = (mid, high) if _chi2_sf(mid, df) > alpha else (low, mid)
    return high


def _expected(logits: torch.Tensor, temperature: float, top_k: int = 0,
              top_p: float = 1.0) -> np.ndarray:
    """The exact sampling distribution [V], float64 (0 outside the kept set)."""
    z = logits.double().numpy() / temperature
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")  # most likely first
    keep = np.zeros(len(probs), dtype=bool)
    keep[order[:top_k or len(probs)]] = True
    probs = np.where(keep, probs, 0.0) / probs[keep].sum()
    # The smallest prefix whose mass reaches top_p: a token is kept while the mass before
    # it is below top_p.
    before = np.cumsum(probs[order]) - probs[order]
    keep[order[before >= top_p]] = False
    return np.where(keep, probs, 0.0) / probs[keep].sum()


def _counts(params: SamplingParams, num_draws: int = NUM_DRAWS) -> np.ndarray:
    """Token counts [V] of num_draws draws: one batch, one row per output index."""
    batch = LOGITS.expand(num_draws, -1)  # [num_draws, V]
    tokens = sample_tokens(batch, [params] * num_draws, list(range(num_draws)))
    return np.bincount(tokens, minlength=LOGITS.numel())


def _assert_fits(counts: np.ndarray, expected: np.ndarray) -> None:
    kept = expected > 0
    outside = np.flatnonzero(~kept & (counts > 0))
    assert outside.size == 0, f"tokens {outside.tolist()} are outside the kept set"
    mean = counts.sum() * expected[kept]
    assert mean.min() >= 5, "too few draws for the chi-square approximation"
    statistic = float(((counts[kept] - mean) ** 2 / mean).sum())
    critical = _chi2_critical(int(kept.sum()) - 1)
    assert statistic <= critical, (
        f"chi-square {statistic:.1f} > {critical:.1f} (df {kept.sum() - 1}): counts "
        f"{counts[kept].tolist()}, expected {np.round(mean, 1).tolist()}")


def test_the_critical_values_are_the_chi_square_quantiles() -> None:
    """Closed forms: df 2 is exponential (x = -2 ln alpha), df 1 a squared normal, and
    df 2m has P(X > x) = exp(-x/2) * sum_{i<m} (x/2)^i / i!."""
    assert _chi2_critical(2) == pytest.approx(-2 * math.log(FALSE_ALARM), rel=1e-9)
    z = math.sqrt(_chi2_critical(1))
    assert math.erfc(z / math.sqrt(2)) == pytest.approx(FALSE_ALARM, rel=1e-6)
    for df in (4, 10, 16):
        half = _chi2_critical(df) / 2
        tail = math.exp(-half) * sum(half**i / math.factorial(i) for i in range(df // 2))
        assert tail == pytest.approx(FALSE_ALARM, rel=1e-6)


@pytest.mark.parametrize("temperature", [0.7, 1.6])
def test_draws_follow_the_softmax_at_the_temperature(temperature: float) -> None:
    params = SamplingParams(temperature=temperature, seed=34)
    _assert_fits(_counts(params), _expected(LOGITS, temperature))


def test_top_k_draws_follow_the_renormalised_top_k() -> None:
    params = SamplingParams(temperature=1.3, top_k=5, seed=35)
    expected = _expected(LOGITS, 1.3, top_k=5)
    assert (expected > 0).sum() == 5
    _assert_fits(_counts(params), expected)


def test_top_p_draws_follow_the_smallest_prefix_reaching_p() -> None:
    """At T = 1.3 the five most likely tokens hold 0.744 and six hold 0.815: top_p 0.8 keeps
    six (the sixth is where the mass reaches 0.8), away from either edge."""
    params = SamplingParams(temperature=1.3, top_p=0.8, seed=36)
    expected = _expected(LOGITS, 1.3, top_p=0.8)
    assert (expected > 0).sum() == 6
    _assert_fits(_counts(params), expected)


def test_top_k_then_top_p_over_the_renormalised_top_k() -> None:
    """top_k 8 renormalises first; over those eight, four hold 0.717 and five 0.815, so
    top_p 0.75 keeps five (over all twelve it would keep six)."""
    params = SamplingParams(temperature=1.3, top_k=8, top_p=0.75, seed=37)
    expected = _expected(LOGITS, 1.3, top_k=8, top_p=0.75)
    assert (expected > 0).sum() == 5
    _assert_fits(_counts(params), expected)
