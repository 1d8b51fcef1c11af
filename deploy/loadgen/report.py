"""Results as vLLM-compatible JSON, and as a readable table on the terminal.

JSON layout: {"date", "config", "workload", "runs": [run, ...]}; each run has vLLM's keys
(duration, completed, failed, request_throughput, request_goodput, mean_ttft_ms,
p99_itl_ms, ..., input_lens, output_lens, ttfts, itls, latencies, start_times, errors) plus
target, backend, request_rate, statuses, tags and failures_by_status, and the prefix cache's
figures:
total_cached_prompt_tokens, prefix_cache_hit_rate, mean_kv_bytes_shipped,
mean_kv_bytes_not_shipped, and per request cached_prompt_tokens, kv_bytes_shipped,
kv_bytes_not_shipped. With a single run, its keys are also copied to the top level, so tools
that read vLLM's result files read this one.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
from pathlib import Path
from typing import Any

from deploy.loadgen.bench import BenchmarkResult, RunResult
from deploy.loadgen.metrics import METRIC_NAMES, BenchmarkMetrics

_LABELS = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2EL"}


def percentile_word(p: float) -> str:
    """vLLM's spelling: 99 -> "99", 99.9 -> "99.9"."""
    return str(int(p)) if int(p) == p else str(p)


def _finite(value: float) -> float | str:
    return value if math.isfinite(value) else str(value)  # JSON has no inf


def run_to_dict(run: RunResult) -> dict[str, Any]:
    m, records = run.metrics, run.records
    out: dict[str, Any] = {
        "target": run.target, "backend": run.backend, "model": run.model,
        "placement": run.placement, "interrupted": run.is_interrupted,
        "request_rate": _finite(run.request_rate),
        "duration": m.duration_s, "completed": m.completed, "failed": m.failed,
        "failures_by_status": m.failures_by_status,
        "total_input_tokens": m.total_input, "total_output_tokens": m.total_output,
        "request_throughput": m.request_throughput, "request_goodput": m.request_goodput,
        "output_throughput": m.output_throughput,
        "total_token_throughput": m.total_token_throughput,
        "max_output_tokens_per_s": m.max_output_tokens_per_s,
        "max_concurrent_requests": m.max_concurrent_requests,
        "total_cached_prompt_tokens": m.total_cached_prompt_tokens,
        "total_template_tokens": m.total_template_tokens,
        "prefix_cache_hit_rate": m.prefix_cache_hit_rate,
        "mean_kv_bytes_shipped": m.mean_kv_bytes_shipped,
        "mean_kv_bytes_not_shipped": m.mean_kv_bytes_not_shipped,
        "cache_reported": m.cache_reported,
    }
    for name in METRIC_NAMES:
        stats = m.stats(name)
        out[f"mean_{name}_ms"] = stats.mean_ms
        out[f"median_{name}_ms"] = stats.median_ms
        out[f"std_{name}_ms"] = stats.std_ms
        for p, value in stats.percentiles_ms:
            out[f"p{percentile_word(p)}_{name}_ms"] = value
    out.update({
        "input_lens": [r.prompt_len for r in records],
        "output_lens": [r.output_len if r.is_success else 0 for r in records],
        "ttfts": [r.ttft_s for r in records], "itls": [list(r.itls_s) for r in records],
        "latencies": [r.latency_s for r in records],
        "start_times": [r.start_s for r in records],
        "statuses": [r.status for r in records], "errors": [r.error for r in records],
        "tags": [r.tag for r in records],
        "cached_prompt_tokens": [r.cached_prompt_tokens for r in records],
        "kv_bytes_shipped": [r.kv_bytes_shipped for r in records],
        "kv_bytes_not_shipped": [r.kv_bytes_not_shipped for r in records],
        "template_tokens": [r.template_tokens for r in records],
    })
    return out


def _config_dict(result: BenchmarkResult) -> dict[str, Any]:
    config = dataclasses.asdict(result.config)
    config["request_rates"] = [_finite(r) for r in result.config.request_rates]
    return config


def result_to_dict(result: BenchmarkResult) -> dict[str, Any]:
    runs = [run_to_dict(run) for run in result.runs]
    out: dict[str, Any] = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "config": _config_dict(result), "models": result.models,
        "workload": result.workload_params or result.workload,
        "workload_repr": result.workload,
    }
    if len(runs) == 1:
        out.update(runs[0])
    out["runs"] = runs
    return out


def write_json(result: BenchmarkResult, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result_to_dict(result), indent=1, default=str) + "\n")
    return path


def _row(label: str, value: object) -> str:
    text = f"{value:.2f}" if isinstance(value, float) else str(value)
    return f"{label:<40} {text:<10}"


def format_run(run: RunResult) -> str:
    """vLLM's result block for one run."""
    m = run.metrics
    cut = " (interrupted)" if run.is_interrupted else ""
    lines = [f" {run.target} @ {run.request_rate:g} req/s{cut} ".center(50, "="),
             _row("Successful requests:", m.completed), _row("Failed requests:", m.failed)]
    lines += [_row(f"  {status}:", count) for status, count in m.failures_by_status.items()]
    lines += [_row("Benchmark duration (s):", m.duration_s),
              _row("Total input tokens:", m.total_input)]
    if m.total_template_tokens:
        lines.append(_row("  + chat template tokens:", m.total_template_tokens))
    lines += [_row("Total generated tokens:", m.total_output),
              _row("Request throughput (req/s):", m.request_throughput)]
    if m.request_goodput is not None:
        lines.append(_row("Request goodput (req/s):", m.request_goodput))
    lines += [_row("Output token throughput (tok/s):", m.output_throughput),
              _row("Total token throughput (tok/s):", m.total_token_throughput),
              " Prefix cache ".center(50, "-"),
              _row("Cached prompt tokens:", _cached(m, m.total_cached_prompt_tokens)),
              _row("Prefix cache hit rate (%):", _cached(m, 100 * m.prefix_cache_hit_rate)),
              _row("K/V bytes shipped per request:", _bytes(_known(run, m.mean_kv_bytes_shipped))),
              _row("K/V bytes not shipped per request:",
                   _bytes(_known(run, m.mean_kv_bytes_not_shipped)))]
    for name in METRIC_NAMES:
        stats, label = m.stats(name), _LABELS[name]
        lines.append(f" {label} ".center(50, "-"))
        lines += [_row(f"Mean {label} (ms):", stats.mean_ms),
                  _row(f"Median {label} (ms):", stats.median_ms),
                  _row(f"Std {label} (ms):", stats.std_ms)]
        lines += [_row(f"P{percentile_word(p)} {label} (ms):", v) for p, v in
                  stats.percentiles_ms]
    return "\n".join(lines + ["=" * 50])


def format_comparison(result: BenchmarkResult) -> str:
    """One row per target and rate: the figures a comparison looks at."""
    p = max(result.config.percentiles)
    word = percentile_word(p)
    has_goodput = any(run.metrics.request_goodput is not None for run in result.runs)
    columns = ["target", "backend", "rate (req/s)", "done", "failed", "achieved (req/s)",
               *(["goodput (req/s)"] if has_goodput else []),
               *(f"{q} {name} (ms)" for name in ("TTFT", "ITL", "TPOT")
                 for q in ("p50", f"p{word}")),
               "cache hits", "K/V KiB/req"]
    lines = ["| " + " | ".join(columns) + " |", "|---|---" + "|---:" * (len(columns) - 2) + "|"]
    for run in result.runs:
        m = run.metrics
        cells = [run.target, run.backend, f"{run.request_rate:g}", str(m.completed),
                 str(m.failed), f"{m.request_throughput:.2f}"]
        if has_goodput:
            cells.append("-" if m.request_goodput is None else f"{m.request_goodput:.2f}")
        for name in ("ttft", "itl", "tpot"):
            stats = m.stats(name)
            cells += [f"{stats.median_ms:.1f}", f"{stats.percentile_ms(p):.1f}"]
        shipped = _known(run, m.mean_kv_bytes_shipped / 1024)
        hits = _cached(m, 100 * m.prefix_cache_hit_rate)
        cells += [hits if isinstance(hits, str) else f"{hits:.1f}%",
                  shipped if isinstance(shipped, str) else f"{shipped:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _bytes(value: float | str) -> int | str:
    """A byte count as a whole number (a mean of bytes has no useful decimals)."""
    return value if isinstance(value, str) else round(value)


def _cached(m: BenchmarkMetrics, value: float) -> float | str:
    """A cache figure, where the server reported it (kvferry with
    --enable-prompt-tokens-details, vLLM with its own): elsewhere it is unknown, not 0."""
    return value if m.cache_reported else "unknown"


def _known(run: RunResult, value: float) -> float | str:
    """K/V bytes are reported by kvferry's gRPC front only, with its cache details:
    elsewhere they are unknown."""
    return value if run.backend == "grpc" and run.metrics.cache_reported else "unknown"


def describe(result: BenchmarkResult) -> str:
    """One line naming what was measured: the model(s) and the workload."""
    params = result.workload_params
    shape = ", ".join(f"{k}={v}" for k, v in params.items() if k != "kind") or result.workload
    models = ", ".join(result.models) or "model not reported"
    return f"{models}; {params.get('kind', 'workload')}({shape})"


def format_result(result: BenchmarkResult) -> str:
    """A line naming model and workload, then vLLM's block for a single run, or a comparison
    table for several (JSON has the rest)."""
    body = (format_run(result.runs[0]) if len(result.runs) == 1
            else format_comparison(result))
    return f"{describe(result)}\n{body}"
