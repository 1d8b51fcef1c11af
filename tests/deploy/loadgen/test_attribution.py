"""Attribution of slow inter-token gaps, on hand-written trace folders with planted causes.

Every synthetic request streams updates 10 ms apart: 2 ms idle, an 8 ms step, then deliver,
router read, router write and client arrival a fraction of a millisecond apart each. A plant
adds 50 ms to one stage of one update (gap 60 ms against a median of 10 ms)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import pytest

from deploy.loadgen import attribution as at

IDLE, STEP, LOOP, TRANSIT, RELAY, CLIENT = 0.002, 0.008, 0.0005, 0.0005, 0.0002, 0.0003
EXTRA = 0.050
DECODE, ROUTER, CLIENT_FILE = "decode-100", "router-200", "client-300"


class Plant(NamedTuple):
    idle_s: float = 0.0  # more idle before the step
    span: str | None = None  # a worker span ("gc", "kv", ...) covering the planted idle/loop
    wall_s: float = 0.0  # a longer step
    cpu_s: float | None = None  # the step thread's CPU (default: 90% of a normal step)
    other_cpu_s: float = 0.0  # extra CPU of other threads in the step
    loop_s: float = 0.0
    transit_s: float = 0.0  # the router reads this update (and the ones queued behind) late
    relay_s: float = 0.0
    client_s: float = 0.0
    num_extra_steps: int = 0  # steps merged into this update before its producer
    idle_cpu_s: float | None = None  # the process's CPU in the idle before the step (clocks)


def _append(folder: Path, stem: str, events: list[dict]) -> None:
    with (folder / f"{stem}.jsonl").open("a") as f:
        f.writelines(json.dumps(e) + "\n" for e in events)


def write_request(folder: Path, plants: dict[int, Plant] | None = None, *, rid: str = "r1",
                  start: float = 1.0, tag: str = "short", phase: str = "loaded",
                  num_updates: int = 20, worker: str = DECODE, step_s: float = STEP,
                  roles: tuple[str, ...] = ("decode", "router", "client"),
                  clocks: bool = False) -> None:
    """One request's traces; update 0 is the prefill token, read by the router at `start`."""
    plants = plants or {}
    down, steps, spans, relays, arrivals = f"down-{rid}", [], [], [], []
    first_s = int(start * 1000)  # step numbers are unique within a worker
    t_out = start + RELAY
    relays.append({"ev": "relay", "id": rid, "down": down, "n": 1, "t_in": start,
                   "t_out": t_out})
    arrivals.append(t_out + CLIENT)
    anchor, pclock = start, 0.0  # pclock: the process's CPU clock (p0/p1 with `clocks`)

    def clock(step: dict, idle_cpu: float) -> dict:
        nonlocal pclock
        if clocks:
            step["p0"] = pclock + idle_cpu
            step["p1"] = pclock = step["p0"] + step["pcpu"]
        return step

    for k in range(1, num_updates):
        p = plants.get(k, Plant())
        for _ in range(p.num_extra_steps):
            steps.append(clock({"ev": "step", "t0": anchor + IDLE, "t1": anchor + IDLE + STEP,
                                "s": first_s + len(steps), "ids": [down], "cpu": 0.9 * STEP,
                                "pcpu": STEP}, IDLE))
            anchor += IDLE + STEP
        t0 = anchor + IDLE + p.idle_s
        t1 = t0 + step_s + p.wall_s
        cpu = 0.9 * step_s if p.cpu_s is None else p.cpu_s
        steps.append(clock({"ev": "step", "t0": t0, "t1": t1, "s": first_s + len(steps),
                            "ids": [down], "cpu": cpu, "pcpu": cpu + 0.0002 + p.other_cpu_s},
                           IDLE + p.idle_s if p.idle_cpu_s is None else p.idle_cpu_s))
        deliver = t1 + LOOP + p.loop_s
        steps.append({"ev": "deliver", "t": deliver, "s": steps[-1]["s"]})
        if p.span and p.idle_s:
            spans.append({"ev": p.span, "t0": t0 - p.idle_s, "t1": t0})
        if p.span and p.loop_s:
            spans.append({"ev": p.span, "t0": t1, "t1": t1 + p.loop_s})
        t_in = max(deliver + TRANSIT + p.transit_s, relays[-1]["t_in"] + 1e-6)
        t_out = t_in + RELAY + p.relay_s
        relays.append({"ev": "relay", "id": rid, "down": down, "n": 1 + p.num_extra_steps,
                       "t_in": t_in, "t_out": t_out})
        arrivals.append(t_out + CLIENT + p.client_s)
        anchor = deliver if p.loop_s else t1  # a busy loop also holds back the next step
    if "decode" in roles:
        _append(folder, worker, steps + spans)
    if "router" in roles:
        _append(folder, ROUTER, relays)
    _append(folder, CLIENT_FILE, [{"ev": "arrivals", "id": rid, "tag": tag, "phase": phase,
                                   "t": arrivals, "n": [1] * len(arrivals)}])


def only_row(folder: Path, **kwargs: object) -> at.GapRow:
    attr = at.attribute(folder, **kwargs)
    assert attr.num_slow == 1, attr.rows
    return attr.rows[0]


@pytest.mark.parametrize("plant, cause", [
    (Plant(idle_s=EXTRA, span="gc"), "gc pause"),
    (Plant(idle_s=EXTRA, span="kv"), "K/V receive on the loop"),
    (Plant(idle_s=EXTRA, span="prefill"), "colocated prefill"),
    (Plant(idle_s=EXTRA, span="write"), "stream writes"),
    (Plant(idle_s=EXTRA), "between steps: other"),
    (Plant(wall_s=EXTRA, cpu_s=0.9 * STEP), "step: descheduled (CPU contention)"),
    (Plant(wall_s=EXTRA, cpu_s=0.9 * STEP, other_cpu_s=EXTRA), "step: GIL held by another thread"),
    (Plant(wall_s=EXTRA, cpu_s=STEP + EXTRA), "step: compute (batch 1)"),
    (Plant(loop_s=EXTRA), "decode event loop busy"),
    (Plant(loop_s=EXTRA, span="gc"), "gc pause"),
    (Plant(transit_s=EXTRA), "decode->router stream"),
    (Plant(relay_s=EXTRA), "router relay"),
    (Plant(client_s=EXTRA), "router->client / client"),
    (Plant(num_extra_steps=4), "steps: several tokens in one update"),
])
def test_planted_cause_is_named(tmp_path: Path, plant: Plant, cause: str) -> None:
    write_request(tmp_path, {7: plant})
    row = only_row(tmp_path)
    assert (row.request_id, row.k, row.cause) == ("r1", 7, cause)
    assert sum(row.contributions.values()) == pytest.approx(row.gap_s)
    assert row.contributions[cause] == pytest.approx(row.gap_s - 0.010, abs=0.002)


def test_lag_span_names_event_loop_lag(tmp_path: Path) -> None:
    write_request(tmp_path, {5: Plant(idle_s=EXTRA)})
    t = 1.0 + 4 * (IDLE + STEP) + IDLE + EXTRA  # the planted idle ends here
    _append(tmp_path, DECODE, [{"ev": "lag", "t": t, "lag": EXTRA}])
    assert only_row(tmp_path).cause == "event-loop lag"


def test_first_gap_is_anchored_at_the_prefill_token(tmp_path: Path) -> None:
    write_request(tmp_path, {1: Plant(idle_s=EXTRA, span="gc")})
    row = only_row(tmp_path)
    assert (row.k, row.cause) == (1, "gc pause")
    assert sum(row.contributions.values()) == pytest.approx(row.gap_s)


def test_a_delay_shared_by_families_names_the_two_largest(tmp_path: Path) -> None:
    """Thirds in three families (decode process work, router and client, CPU contention):
    no category and no family holds half the excess, but all of it is measured."""
    write_request(tmp_path, {6: Plant(idle_s=0.36 * EXTRA, span="gc", relay_s=0.34 * EXTRA,
                                      wall_s=0.3 * EXTRA, cpu_s=0.9 * STEP)})
    row = only_row(tmp_path)
    assert row.cause == "several: decode process work + router and client"
    assert row.contributions["gc pause"] == pytest.approx(0.36 * EXTRA)


def test_a_gap_mostly_unaccounted_for_is_unexplained() -> None:
    from deploy.loadgen import causes

    parts = {causes.BASELINE: 0.010, causes.IDLE_OTHER: 0.015, causes.UNTRACED: 0.015,
             causes.RELAY: 0.010, causes.DESCHEDULED: 0.010}
    assert causes.name_cause(parts, 0.060, 0.010) == causes.SPREAD
    parts[causes.IDLE_OTHER] = parts[causes.UNTRACED] = 0.005  # now mostly measured
    parts[causes.GIL] = 0.020
    assert causes.name_cause(parts, 0.060, 0.010).startswith("several: ")


def test_a_gap_one_family_explains_is_mixed(tmp_path: Path) -> None:
    write_request(tmp_path, {6: Plant(idle_s=0.25 * EXTRA, span="gc", relay_s=0.4 * EXTRA,
                                      client_s=0.35 * EXTRA)})
    assert only_row(tmp_path).cause == "mixed: router and client"


@pytest.mark.parametrize("idle_cpu_s, cause", [
    (IDLE, "between steps: descheduled (CPU contention)"),  # the process did not run
    (IDLE + EXTRA, "between steps: decode process busy (loop, gRPC threads)"),
])
def test_idle_no_span_claims_is_split_by_the_process_cpu(tmp_path: Path, idle_cpu_s: float,
                                                         cause: str) -> None:
    write_request(tmp_path, {7: Plant(idle_s=EXTRA, idle_cpu_s=idle_cpu_s)}, clocks=True)
    row = only_row(tmp_path)
    assert row.cause == cause
    assert row.contributions[cause] == pytest.approx(EXTRA, abs=0.003)
    assert sum(row.contributions.values()) == pytest.approx(row.gap_s)


def test_missing_decode_trace_is_untraced_but_router_stages_still_count(tmp_path: Path) -> None:
    write_request(tmp_path, {3: Plant(idle_s=EXTRA, span="gc"), 9: Plant(relay_s=EXTRA)},
                  roles=("router", "client"))
    rows = {row.k: row for row in at.attribute(tmp_path).rows}
    assert (rows[3].cause, rows[9].cause) == ("untraced", "router relay")


def test_request_without_relays_is_untraced(tmp_path: Path) -> None:
    write_request(tmp_path, {3: Plant(relay_s=EXTRA)}, roles=("decode", "client"))
    row = only_row(tmp_path)
    assert row.cause == "untraced"
    assert row.contributions == {"untraced": pytest.approx(row.gap_s)}


def test_spans_of_another_worker_explain_nothing(tmp_path: Path) -> None:
    write_request(tmp_path, {4: Plant(idle_s=EXTRA, span="gc")}, rid="a", worker="decode-1")
    write_request(tmp_path, {4: Plant(idle_s=EXTRA)}, rid="b", worker="decode-2")
    causes = {row.request_id: row.cause for row in at.attribute(tmp_path).rows}
    assert causes == {"a": "gc pause", "b": "between steps: other"}


def test_summary_and_explained_share(tmp_path: Path) -> None:
    write_request(tmp_path, {3: Plant(idle_s=EXTRA, span="gc"), 8: Plant(idle_s=EXTRA,
                                                                          span="gc")}, rid="a")
    write_request(tmp_path, {5: Plant(relay_s=2 * EXTRA)}, rid="b", start=10.0)
    write_request(tmp_path, {5: Plant(idle_s=EXTRA)}, rid="c", start=20.0)
    attr = at.attribute(tmp_path)
    assert (attr.num_gaps, attr.num_slow, attr.num_explained) == (57, 4, 3)
    assert attr.median_itl_s == pytest.approx(0.010)
    assert attr.explained_share == pytest.approx(0.75)
    assert [(c.cause, c.num_gaps, c.share) for c in attr.causes] == [
        ("gc pause", 2, 0.5), ("between steps: other", 1, 0.25), ("router relay", 1, 0.25)]
    assert attr.causes[2].median_gap_s == pytest.approx(0.110, abs=1e-3)
    table = at.format_table(attr)
    assert "gc pause" in table.splitlines()[1] and "50.0%" in table.splitlines()[1]
    assert table.splitlines()[-1] == "explained: 3 of 4 (75%)"


def test_tag_and_phase_select_requests(tmp_path: Path) -> None:
    write_request(tmp_path, {3: Plant(idle_s=EXTRA, span="gc")}, rid="s")
    write_request(tmp_path, {3: Plant(relay_s=EXTRA)}, rid="l", tag="long", start=10.0)
    write_request(tmp_path, {3: Plant(client_s=EXTRA)}, rid="x", phase="idle", start=20.0)
    assert {r.request_id for r in at.attribute(tmp_path).rows} == {"s", "x"}
    assert {r.request_id for r in at.attribute(tmp_path, tag=None).rows} == {"s", "l", "x"}
    assert [r.request_id for r in at.attribute(tmp_path, phase="loaded").rows] == ["s"]
    assert at.attribute(tmp_path, phase="none").num_gaps == 0


def test_factor_sets_the_slow_threshold(tmp_path: Path) -> None:
    write_request(tmp_path, {3: Plant(relay_s=0.015)})  # a 25 ms gap
    assert at.attribute(tmp_path).num_slow == 0
    assert only_row(tmp_path, factor=2.0).cause == "router relay"
    with pytest.raises(ValueError, match="factor"):
        at.attribute(tmp_path, factor=0.0)


def test_torn_lines_and_unknown_events_are_skipped(tmp_path: Path) -> None:
    write_request(tmp_path, {3: Plant(idle_s=EXTRA, span="gc")})
    _append(tmp_path, DECODE, [{"ev": "future", "x": 1}, {"ev": "step", "t0": 1.0}])
    with (tmp_path / f"{DECODE}.jsonl").open("a") as f:
        f.write('{"ev": "gc", "t0": 1.')
    assert only_row(tmp_path).cause == "gc pause"


def test_cli_prints_the_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_request(tmp_path, {3: Plant(relay_s=EXTRA)}, tag="long")
    assert at.main([str(tmp_path), "--tag", "long", "--phase", "loaded"]) == 0
    out = capsys.readouterr().out
    assert "router relay" in out and out.rstrip().endswith("explained: 1 of 1 (100%)")


@pytest.mark.parametrize("make", ["empty", "missing", "blank files"])
def test_cli_exits_2_on_a_bad_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                     make: str) -> None:
    folder = tmp_path / "traces"
    if make != "missing":
        folder.mkdir()
    if make == "blank files":
        (folder / "decode-1.jsonl").write_text("\n")
    assert at.main([str(folder)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and captured.err.startswith("attribution: ")


def test_baseline_is_the_median_step_of_the_phase(tmp_path: Path) -> None:
    write_request(tmp_path, {4: Plant(idle_s=EXTRA, span="gc")}, rid="a")
    write_request(tmp_path, {4: Plant(idle_s=EXTRA, span="gc")}, rid="b", phase="slow",
                  step_s=0.020, start=10.0)
    rows = {r.request_id: r for r in at.attribute(tmp_path, phase="slow").rows}
    assert rows["b"].contributions["baseline (median step)"] == pytest.approx(0.020)
    assert rows["b"].contributions["step: compute (batch 1)"] == pytest.approx(0.0)
    rows = {r.request_id: r for r in at.attribute(tmp_path, phase="loaded").rows}
    assert rows["a"].contributions["baseline (median step)"] == pytest.approx(STEP)


def test_batch_size_names_the_compute_cause(tmp_path: Path) -> None:
    write_request(tmp_path, {6: Plant(wall_s=EXTRA, cpu_s=STEP + EXTRA)})
    lines = (tmp_path / f"{DECODE}.jsonl").read_text().splitlines()
    batched = [json.loads(line) for line in lines]
    for e in batched:
        if e["ev"] == "step":
            e["ids"] += ["other-1", "other-2"]
    (tmp_path / f"{DECODE}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in batched))
    assert only_row(tmp_path).cause == "step: compute (batch 3)"


def test_the_first_decode_token_waits_to_join_the_batch(tmp_path: Path) -> None:
    """Idle between the router's read of the prefill token and the first decode step is
    the request joining the decode worker, not an unexplained pause."""
    write_request(tmp_path, {1: Plant(idle_s=EXTRA)}, clocks=True)
    row = only_row(tmp_path)
    assert (row.k, row.cause) == (1, "first decode step: start, K/V arrival, joining the batch")


def test_the_wait_to_join_is_cut_at_the_start_command_and_the_attach(tmp_path: Path) -> None:
    """With the router's start and the engine's attach traced, the first decode step's wait
    is split: 10 ms awaiting the push's end, 30 ms in transit, 10 ms to the batch's turn."""
    write_request(tmp_path, {1: Plant(idle_s=EXTRA)}, clocks=True)
    read_prefill_token, first_step = 1.0, 1.0 + IDLE + EXTRA
    _append(tmp_path, ROUTER, [{"ev": "start", "t": read_prefill_token + 0.010 + IDLE,
                                "down": "down-r1"}])
    _append(tmp_path, DECODE, [{"ev": "attach", "t": first_step - 0.010, "id": "down-r1"}])
    row = only_row(tmp_path)
    assert row.cause == "first decode step: start command in transit"
    parts = row.contributions
    assert parts["first decode step: router awaiting the push's end"] == pytest.approx(
        0.010 + IDLE, abs=1e-6)
    assert parts["first decode step: start command in transit"] == pytest.approx(0.030, abs=1e-6)
    assert parts["first decode step: admission, the batch's next turn"] == pytest.approx(
        0.010, abs=1e-6)
