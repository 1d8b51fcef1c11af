"""`kvferry profile` on the tiny model, end to end: it launches 1 prefill + 1 decode worker,
then 1 colocated worker, measures through Generate, writes a profile the planner reads, and
`plan --sla` answers from it."""

from __future__ import annotations

from pathlib import Path

import pytest

from deploy.cli import main
from deploy.default_model import tiny_model
from deploy.planner.profile import CostModel, Profile

pytestmark = pytest.mark.slow


def test_profile_measures_what_plan_reads(tmp_path: Path,
                                          capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "tiny.json"
    code = main(["profile", "--model", tiny_model(), "--out", str(out),
                 "--prompt-lens", "16,256,1024", "--decode-batches", "1,4,8",
                 "--decode-contexts", "64", "--repeats", "2",
                 "--log-dir", str(tmp_path / "logs")])
    printed = capsys.readouterr().out
    assert code == 0 and f"profile: {out}" in printed
    profile = Profile.load(out)
    assert profile.model and profile.device == "cpu" and profile.num_cores >= 1
    assert [p.tokens for p in profile.prefill[:3]] == [16, 256, 1024]
    # every point was measured; which costs more is a timing, left to the fit below
    assert all(p.seconds > 0 for p in profile.prefill)
    assert {p.batch for p in profile.decode} == {1, 4, 8}
    assert all(len(p.jitter) == 20 and p.seconds > 0 for p in profile.decode)
    assert len(profile.transfer) == len(profile.receive) == 3
    assert profile.relay_s_per_token > 0 or profile.router_s_per_request > 0
    cost = CostModel(profile)
    # the fit's terms are never negative, so a longer prompt never costs less
    assert cost.prefill_s(1024, 1024 ** 2) >= cost.prefill_s(16, 16 ** 2) > 0
    # then one colocated worker, the same sweep
    assert [p.tokens for p in profile.colocated_prefill[:3]] == [16, 256, 1024]
    assert {p.batch for p in profile.colocated_decode} == {1, 4, 8}
    colocated = cost.colocated()
    assert colocated.is_colocated
    assert colocated.prefill_s(1024, 1024 ** 2) >= colocated.prefill_s(16, 16 ** 2) > 0
    code = main(["plan", "--sla", "ttft-p90=5000,itl-p90=1000", "--workload", "64:8",
                 "--profile", str(out), "--max-workers", "2", "--num-requests", "50"])
    assert code == 0 and "recommendation:" in capsys.readouterr().out


@pytest.mark.ray
def test_profile_on_ray_measures_the_actors(tmp_path: Path, ray_session: None,
                                            capsys: pytest.CaptureFixture) -> None:
    """--kv-transport ray: the workers are Ray actors and the K/V travels as object refs,
    as `serve --kv-transport ray` runs them; their processes' CPU is what is counted."""
    out = tmp_path / "tiny-ray.json"
    code = main(["profile", "--model", tiny_model(), "--out", str(out), "--kv-transport", "ray",
                 "--prompt-lens", "16,256", "--decode-batches", "1,4",
                 "--decode-contexts", "64", "--repeats", "2"])
    assert code == 0 and f"profile: {out}" in capsys.readouterr().out
    profile = Profile.load(out)
    assert profile.kv_transport == "ray" and profile.torch_threads >= 1
    assert [p.tokens for p in profile.prefill[:2]] == [16, 256]
    assert all(p.seconds > 0 for p in profile.prefill)
    assert len(profile.receive) == 2 and all(p.seconds > 0 for p in profile.decode)
    assert profile.relay_s_per_token > 0 or profile.router_s_per_request > 0
