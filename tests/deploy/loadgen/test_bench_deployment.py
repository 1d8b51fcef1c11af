"""`kvferry bench` against real local deployments (router + workers as processes)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from deploy.cli import main
from deploy.launcher import Deployment
from deploy.loadgen import RandomWorkload
from deploy.placement import ROUTER, cpu_list, plan_cores

pytestmark = pytest.mark.slow


def test_bench_against_the_local_deployment(qwen3_deployment: Deployment,
                                            tmp_path: Path) -> None:
    result_file = tmp_path / "bench.json"
    code = main(["bench", "--address", qwen3_deployment.router_address, "--num-prompts", "4",
                 "--input-len", "24", "--output-len", "8", "--range-ratio", "0.25",
                 "--request-rate", "8", "--num-warmups", "1", "--goodput", "ttft:60000",
                 "--disable-tqdm", "--result-file", str(result_file)])
    assert code == 0
    data = json.loads(result_file.read_text())
    assert data["completed"] == 4 and data["failed"] == 0
    # Exactly the lengths the workload asked for: prompts as token ids, max_tokens with
    # ignore_eos (the server's usage reports the prompt lengths).
    vocab = json.loads((Path(qwen3_deployment.model) / "config.json").read_text())["vocab_size"]
    sent = RandomWorkload(input_len=24, output_len=8, range_ratio=0.25).build(4, vocab, 0)
    assert data["input_lens"] == [r.prompt_len for r in sent]
    assert data["output_lens"] == [r.output_len for r in sent]
    assert data["total_output_tokens"] == sum(r.output_len for r in sent)
    assert 0 < data["median_ttft_ms"] <= data["p99_ttft_ms"] < 60_000
    assert data["mean_itl_ms"] > 0 and data["mean_tpot_ms"] > 0
    assert data["mean_e2el_ms"] > data["mean_ttft_ms"]
    assert data["request_goodput"] == pytest.approx(data["request_throughput"])
    for itls, n in zip(data["itls"], data["output_lens"]):
        assert 1 <= len(itls) <= n - 1  # one gap per chunk; a chunk may carry several tokens


def test_compare_a_running_deployment_and_the_traced_http_front_of_a_launched_one(
        qwen3_deployment: Deployment, qwen3_checkpoint: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """`--compare` of the running deployment's gRPC front and a launched colocated one's HTTP
    front (`openai-completions:launch:KIND` launches the router with its HTTP front and
    drives it with the OpenAI backend; the vocabulary comes from the same router's gRPC
    front), with `--trace DIR`: the client and the launched router and worker write their
    traces there (the running deployment was not started tracing), a table of slow gaps
    follows the results, and the variable is not left set."""
    result_file, folder = tmp_path / "compare.json", tmp_path / "trace"
    code = main(["bench", "--compare", f"grpc={qwen3_deployment.router_address}",
                 "http=openai-completions:launch:colocated", "--model", str(qwen3_checkpoint),
                 "--kv-pool-size", "256MiB",
                 "--launch-log-dir", str(tmp_path / "logs"), "--num-prompts", "4",
                 "--input-len", "16", "--output-len", "12", "--request-rate", "20",
                 "--disable-tqdm", "--result-file", str(result_file),
                 "--plot-dir", str(tmp_path / "plots"), "--trace", str(folder)])
    assert code == 0
    runs = json.loads(result_file.read_text())["runs"]
    assert [(r["target"], r["backend"]) for r in runs] == [("grpc", "grpc"),
                                                           ("http", "openai-completions")]
    client = cpu_list(sorted(os.sched_getaffinity(0)))  # where pytest runs, restored
    assert runs[0]["placement"] == {"client": client}  # a running target: the client's only
    plan = plan_cores(["colocated-0"], sorted(os.sched_getaffinity(0)))
    if plan.is_pinned:  # the launched one's processes, and the client on the router's
        want = {name: cpu_list(cores) for name, cores in plan.cores.items()}
        assert runs[1]["placement"] == {**want, "client": want[ROUTER]}
    for run in runs:
        assert run["completed"] == 4 and run["failed"] == 0
        assert run["input_lens"] == [16] * 4 and run["output_lens"] == [12] * 4  # usage
        assert run["median_ttft_ms"] > 0
    assert (tmp_path / "plots" / "latency_vs_rate.png").exists()
    roles = {path.name.split("-")[0] for path in folder.glob("*.jsonl")}
    assert roles == {"client", "router", "colocated"}
    out = capsys.readouterr().out
    # Arrivals are traced by the gRPC client: the attribution covers the gRPC run, whose
    # deployment wrote no traces (tests/deploy/loadgen/test_attribution.py covers the causes).
    assert "slow token gaps of bench-grpc-20" in out and "bench-http-20" not in out, out
    assert "explained:" in out and "slow gaps:" in out
    assert "KVFERRY_TRACE_DIR" not in os.environ
