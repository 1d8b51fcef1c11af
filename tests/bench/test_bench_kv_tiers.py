"""bench/bench_kv_tiers.py without servers (the suite's deployment budget is spent): its
arguments, the refusal below 4x the pools, the figures taken from turns (hit rates around
the restart), --concurrency against a fake server, the ratios against the targets, and the
report. Its --quick run was run by hand (its figures are in docs/performance.md)."""

from __future__ import annotations

import math

import pytest

from bench import bench_kv_tiers as bench
from bench.bench_kv_tiers import FULL, QUICK, RATIOS, Figures, Turn, figures, format_report


def test_defaults_and_quick_mode() -> None:
    args = bench.parse_args([])
    assert all(getattr(args, name) == value for name, value in FULL.items())
    assert args.runs == list(bench.RUNS) and args.model == "default"
    quick = bench.parse_args(["--quick", "--conversations", "3"])
    assert quick.conversations == 3
    assert all(getattr(quick, n) == v for n, v in QUICK.items() if n != "conversations")
    with pytest.raises(SystemExit):
        bench.parse_args(["--runs", "host,nowhere"])


def test_it_refuses_histories_under_4x_the_pools(capsys: pytest.CaptureFixture) -> None:
    assert bench.main(["--model", "tiny", "--quick", "--conversations", "2"]) == 2
    assert "needs >= 4x" in capsys.readouterr().err


def test_the_full_workload_is_at_least_4x_the_pools() -> None:
    """The real default model: 30 layers x 3 kv heads x 64 x 4 bytes x 2 = 46,080 B a token."""
    from kvferry.cache.layout import KvShape

    args = bench.parse_args([])
    shape = KvShape(30, 3, 64, "float32")
    assert bench.history_bytes(args, shape) / (2 * (32 << 20)) >= 4


def test_figures_split_the_hit_rate_at_the_restart() -> None:
    turns = [Turn(1, 100, 0, 0.5), Turn(2, 150, 96, 0.1), Turn(3, 200, 144, 0.1),
             Turn(4, 250, 0, 0.4)]  # the restart lost turn 4's history
    got = figures(turns, {"disk": 96}, restart_after=3)
    assert got.tokens_computed == 100 + 54 + 56 + 250
    assert got.hit_rate == pytest.approx(240 / 600)
    assert got.hit_rate_before == pytest.approx(240 / 350)
    assert got.hit_rate_after == 0.0
    assert got.ttft_p50_ms == pytest.approx(250.0)


def _figures(ttft: float, computed: int, before: float = 0.5, after: float = 0.5) -> Figures:
    return Figures(ttft, 2 * ttft, computed, 0.5, {"host": 10}, before, after)


def test_ratios_and_report() -> None:
    runs = {"device": [_figures(300, 9000), _figures(330, 9000)],
            "host": [_figures(100, 2000), _figures(150, 2000)],
            "disk": [_figures(100, 2000, 0.8, 0.7), _figures(100, 2000, 0.8, 0.6)],
            "prefix-2p2d": [_figures(120, 2000)], "priced-2p2d": [_figures(100, 2000)]}
    values = {r.label: r.values(runs) for r in RATIOS}
    assert values["TTFT p50, device / host"] == [3.0, 2.2]
    assert values["prompt tokens computed, device / host"] == [4.5, 4.5]
    assert values["disk: hit rate after / before the restart"] == pytest.approx([0.875, 0.75])
    assert values["TTFT p50, prefix / priced (2p2d, host tiers)"] == [1.2]
    args = bench.parse_args(["--repeats", "2"])
    report = format_report(args, runs, 4.5)
    assert "TTFT p50, device / host: 2.60 [2.20-3.00]  target >= 2  met" in report
    assert "disk: hit rate after / before the restart: 0.81 [0.75-0.87]  target >= 0.8  met" \
        in report
    assert "histories' K/V = 4.5x the device pools" in report
    assert not math.isnan(values["TTFT p50, device / host"][0])


def test_concurrency_puts_that_many_chats_of_a_turn_in_flight(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """--concurrency N: N requests of a turn at once, never two turns of one chat at once, and
    each chat's next prompt is its history plus its answer."""
    import asyncio
    import contextlib
    from types import SimpleNamespace

    in_flight, peak, prompts = 0, 0, []

    async def collect(stub: object, request: object, timeout_s: float) -> SimpleNamespace:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        prompts.append(list(request.token_ids.ids))
        await asyncio.sleep(0.01)  # paces the fake prefill: the others queue behind the gate
        in_flight -= 1
        usage = SimpleNamespace(cached_prompt_tokens=len(request.token_ids.ids) // 2)
        return SimpleNamespace(token_ids=[7, 7], finished=SimpleNamespace(usage=usage),
                               ttft_s=0.01)

    @contextlib.asynccontextmanager
    async def channel(address: str):  # noqa: ANN202
        yield None

    monkeypatch.setattr(bench.client, "collect", collect)
    monkeypatch.setattr(bench.client, "public_stub", lambda chan: None)
    monkeypatch.setattr(bench.grpc_util, "channel", channel)
    args = bench.parse_args(["--quick", "--conversations", "6", "--num-turns", "3",
                             "--output-len", "2", "--concurrency", "3"])
    conversations = bench.chats(args, vocab=50)
    turns = asyncio.run(bench._turns("fake", conversations, range(1, 4), 2, "s", 3))
    assert peak == 3 and len(turns) == len(prompts) == 18
    assert [t.turn for t in turns] == sorted(t.turn for t in turns)  # a turn ends before the next
    first = conversations[0].messages
    assert conversations[0].history == first[0] + [7, 7] + first[1] + [7, 7] + first[2] + [7, 7]
    with pytest.raises(SystemExit):
        bench.parse_args(["--conversations", "4", "--concurrency", "5"])
