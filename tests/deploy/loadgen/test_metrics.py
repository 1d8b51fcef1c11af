"""Metric math against hand-computed values (vLLM `bench serve` definitions)."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from deploy.loadgen.metrics import RequestRecord, Slo, calculate_metrics

# A: chunks at 0.10, 0.15, 0.23 s (1, 1, 2 tokens): TTFT 100 ms, ITLs 50 and 80 ms,
#    E2EL 230 ms, TPOT (230 - 100) / 3 = 43.33 ms.
# B: starts at 0.5 s, chunks at +0.20, +0.35: TTFT 200, ITL 150, E2EL 350, TPOT 150.
# C: starts at 1.0 s, one token at +0.05: TTFT 50, no ITL, E2EL 50, no TPOT (0 for goodput).
# D: refused (RESOURCE_EXHAUSTED).
RECORDS = (
    RequestRecord(prompt_len=10, output_len=4, start_s=0.0, ttft_s=0.10, itls_s=(0.05, 0.08),
                  latency_s=0.23),
    RequestRecord(prompt_len=20, output_len=2, start_s=0.5, ttft_s=0.20, itls_s=(0.15,),
                  latency_s=0.35),
    RequestRecord(prompt_len=5, output_len=1, start_s=1.0, ttft_s=0.05, latency_s=0.05),
    RequestRecord(prompt_len=7, output_len=0, start_s=1.5, status="RESOURCE_EXHAUSTED",
                  error="no room"),
)
approx = pytest.approx


def values(stats_percentiles: tuple[tuple[float, float], ...]) -> list[float]:
    return [v for _, v in stats_percentiles]


def test_counts_and_throughputs() -> None:
    m = calculate_metrics(RECORDS, duration_s=2.0)
    assert (m.completed, m.failed) == (3, 1)
    assert m.failures_by_status == {"RESOURCE_EXHAUSTED": 1}
    assert (m.total_input, m.total_output) == (35, 7)  # failed requests count no tokens
    assert m.request_throughput == approx(1.5)
    assert m.output_throughput == approx(3.5)
    assert m.total_token_throughput == approx(21.0)
    assert m.request_goodput is None  # no SLO given


def test_ttft_stats() -> None:
    ttft = calculate_metrics(RECORDS, 2.0, percentiles=(90, 95, 99)).ttft
    # [50, 100, 200] ms; numpy's linear percentile: p90 = 100 + 0.8 x 100.
    assert ttft.mean_ms == approx(350 / 3)
    assert ttft.median_ms == approx(100)
    assert ttft.std_ms == approx(62.3609564)  # population std
    assert [p for p, _ in ttft.percentiles_ms] == [90, 95, 99]
    assert values(ttft.percentiles_ms) == approx([180, 190, 198])


def test_itl_pools_every_gap_of_every_request() -> None:
    itl = calculate_metrics(RECORDS, 2.0, percentiles=(90, 99)).itl
    # [50, 80, 150] ms: the 2-token chunk of A is one gap, as in vLLM.
    assert itl.mean_ms == approx(280 / 3)
    assert itl.median_ms == approx(80)
    assert values(itl.percentiles_ms) == approx([136, 148.6])


def test_tpot_excludes_single_token_requests() -> None:
    tpot = calculate_metrics(RECORDS, 2.0, percentiles=(90,)).tpot
    # [43.33, 150] ms: C (one token) is left out.
    assert tpot.mean_ms == approx((130 / 3 + 150) / 2)
    assert tpot.median_ms == approx((130 / 3 + 150) / 2)
    assert tpot.percentiles_ms[0][1] == approx(130 / 3 + 0.9 * (150 - 130 / 3))
    assert RECORDS[0].tpot_s == approx(0.13 / 3)


def test_e2el_stats() -> None:
    e2el = calculate_metrics(RECORDS, 2.0, percentiles=(99,)).e2el
    assert e2el.mean_ms == approx(210)
    assert e2el.median_ms == approx(230)
    assert values(e2el.percentiles_ms) == approx([230 + 0.98 * 120])


def test_goodput() -> None:
    # ttft <= 150 and tpot <= 50: A (100, 43.3) and C (50, 0) pass, B (200) fails.
    m = calculate_metrics(RECORDS, 2.0, Slo.parse(["ttft:150", "tpot:50"]))
    assert m.request_goodput == approx(1.0)
    # Adding e2el <= 100 leaves only C.
    m = calculate_metrics(RECORDS, 2.0, Slo.parse(["ttft:150", "tpot:50", "e2el:100"]))
    assert m.request_goodput == approx(0.5)
    # An SLO exactly at a request's value passes it (vLLM: slo >= value).
    m = calculate_metrics(RECORDS, 2.0, Slo(ttft_ms=200))
    assert m.request_goodput == approx(1.5)


def test_peaks() -> None:
    # Peak tokens per second counts chunk arrivals in one-second buckets (vLLM): A's three
    # and B's two fall in the first second.
    m = calculate_metrics(RECORDS, 2.0)
    assert m.max_output_tokens_per_s == 5
    assert m.max_concurrent_requests == 1
    overlapping = [RequestRecord(1, 1, start_s=s, ttft_s=1.0, latency_s=1.0)
                   for s in (0.0, 0.5, 1.0)]
    # [0, 1) and [0.5, 1.5) overlap; the third starts exactly when the first ends.
    assert calculate_metrics(overlapping, 2.0).max_concurrent_requests == 2


def test_empty_lists_count_as_zero_and_all_failed_is_reported() -> None:
    failed = [RequestRecord(3, 0, 0.0, status="UNAVAILABLE")] * 2
    m = calculate_metrics(failed, 1.0, Slo(ttft_ms=10))
    assert (m.completed, m.failed, m.failures_by_status) == (0, 2, {"UNAVAILABLE": 2})
    assert m.ttft.mean_ms == 0 and m.itl.percentiles_ms[-1][1] == 0
    assert m.request_goodput == 0


@pytest.mark.parametrize("bad", [["ttft"], ["speed:3"], ["tpot:-1"], ["ttft:x"]])
def test_bad_goodput_is_a_value_error(bad: list[str]) -> None:
    with pytest.raises(ValueError):
        Slo.parse(bad)


def test_bad_duration() -> None:
    with pytest.raises(ValueError, match="duration_s"):
        calculate_metrics(RECORDS, 0.0)


def test_prefix_cache_hit_rate_and_kv_bytes_per_request() -> None:
    records = [
        RequestRecord(100, 4, 0.0, cached_prompt_tokens=64, kv_bytes_shipped=1000,
                      kv_bytes_not_shipped=3000),
        RequestRecord(60, 4, 0.1, cached_prompt_tokens=16, kv_bytes_shipped=2000),
        RequestRecord(40, 4, 0.2),  # a miss everywhere
        RequestRecord(500, 0, 0.3, status="UNAVAILABLE", cached_prompt_tokens=500,
                      kv_bytes_shipped=10**9),  # failed: not counted
    ]
    m = calculate_metrics(records, 1.0)
    assert m.total_cached_prompt_tokens == 80
    assert m.prefix_cache_hit_rate == approx(80 / 200)
    assert m.mean_kv_bytes_shipped == approx(1000)
    assert m.mean_kv_bytes_not_shipped == approx(1000)


def test_no_completed_request_has_no_hits() -> None:
    m = calculate_metrics([RequestRecord(3, 0, 0.0, status="UNAVAILABLE")], 1.0)
    assert (m.prefix_cache_hit_rate, m.mean_kv_bytes_shipped) == (0.0, 0.0)
    assert m.mean_kv_bytes_not_shipped == 0.0


def test_cache_figures_are_unknown_unless_a_server_reported_them() -> None:
    """A kvferry router without --enable-prompt-tokens-details (or a server that leaves
    `prompt_tokens_details` out) reports no cache figures: the report says unknown, not 0."""
    from deploy.loadgen.report import format_run

    unreported = calculate_metrics([RequestRecord(100, 4, 0.0), RequestRecord(60, 4, 0.1)],
                                   1.0)
    assert not unreported.cache_reported
    reported = calculate_metrics([RequestRecord(100, 4, 0.0, cached_prompt_tokens=0,
                                                cache_reported=True)], 1.0)
    assert reported.cache_reported
    run = SimpleNamespace(target="t", backend="grpc", model="m", placement="", is_interrupted=False,
                          request_rate=1.0, metrics=unreported)
    text = format_run(run)  # type: ignore[arg-type]
    assert re.search(r"Prefix cache hit rate \(%\): +unknown", text)
    assert re.search(r"K/V bytes shipped per request: +unknown", text)
    run.metrics = reported
    assert re.search(r"Prefix cache hit rate \(%\): +0\.00",
                     format_run(run))  # type: ignore[arg-type]
