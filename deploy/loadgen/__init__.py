"""Load generator for kvferry's public Generate stream (`kvferry bench`).

Open-loop arrivals (arrivals), seeded workloads (workload), per-request timing (runner:
the gRPC backend; openai_client and openai_stream: any OpenAI-compatible HTTP server),
vLLM-defined metrics (metrics), targets that may be launched (targets), the orchestration
API (bench), JSON and tables (report), PNG plots (plots), the command (cli).
"""

from __future__ import annotations

from deploy.loadgen.bench import BenchConfig, BenchmarkResult, RunResult, run_benchmark
from deploy.loadgen.metrics import BenchmarkMetrics, RequestRecord, Slo, calculate_metrics
from deploy.loadgen.runner import SendOptions
from deploy.loadgen.targets import Target
from deploy.loadgen.workload import (
    BenchRequest,
    Conversation,
    JsonlWorkload,
    MixedWorkload,
    MultiTurnWorkload,
    RandomWorkload,
    SharedPrefixWorkload,
    ShareGptWorkload,
)

__all__ = [
    "BenchConfig", "BenchRequest", "BenchmarkMetrics", "BenchmarkResult", "Conversation",
    "JsonlWorkload", "MixedWorkload", "MultiTurnWorkload", "RandomWorkload", "RequestRecord",
    "RunResult", "SendOptions", "ShareGptWorkload", "SharedPrefixWorkload", "Slo", "Target",
    "calculate_metrics", "run_benchmark",
]
