"""PNG plots of a benchmark (matplotlib, Agg backend: no display needed).

- latency_vs_rate.png: TTFT p50/p99 and ITL p50/p99 against the request rate each run
  achieved (not the one asked: a saturated server falls short of it), one line per target.
- throughput_vs_rate.png: output tokens per second, and with --goodput requests per second
  within the SLA beside all requests per second, against the achieved rate.
- ttft_vs_itl.png: one point per completed request, TTFT against its mean ITL, a colour
  per target and a marker per rate.
Each is titled with the model(s) and the workload in words; every axis starts at 0.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from deploy.loadgen.bench import BenchmarkResult, RunResult

PANELS = (("ttft", 50.0), ("ttft", 99.0), ("itl", 50.0), ("itl", 99.0))


def _pyplot() -> ModuleType:
    """pyplot on the Agg backend (chosen before pyplot is first imported)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _x(run: RunResult) -> float:
    """The request rate the run achieved."""
    return run.metrics.request_throughput


def title(result: BenchmarkResult) -> str:
    """The model(s) and the workload in words: `SmolLM2 - random workload: input_len 128,
    output_len 64` rather than the workload's Python form."""
    params = result.workload_params
    kind = str(params.get("kind", result.workload or "workload"))
    words = kind.removesuffix("Workload").lower() + " workload" if kind.endswith(
        "Workload") else kind
    shape = ", ".join(f"{k} {v}" for k, v in params.items() if k != "kind")
    models = ", ".join(result.models) or "model not reported"
    return f"{models} - {words}" + (f": {shape}" if shape else "")


def _save(fig: object, plt: ModuleType, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)  # type: ignore[attr-defined]
    plt.close(fig)
    return path


def _value(run: RunResult, metric: str, p: float) -> float:
    stats = run.metrics.stats(metric)
    if p == 50.0:
        return stats.median_ms
    return stats.percentile_ms(p)


def _targets(result: BenchmarkResult) -> list[str]:
    return list(dict.fromkeys(run.target for run in result.runs))


def plot_latency_vs_rate(result: BenchmarkResult, path: Path) -> Path:
    """Four panels; p99 falls back to the highest percentile measured if 99 was not."""
    plt = _pyplot()
    top = 99.0 if 99.0 in result.config.percentiles else max(result.config.percentiles)
    fig, axes = plt.subplots(2, 2, figsize=(10, 7), sharex=True)
    for ax, (metric, p) in zip(axes.flat, PANELS):
        p = p if p == 50.0 else top
        for target in _targets(result):
            runs = sorted((r for r in result.runs if r.target == target), key=_x)
            ax.plot([_x(r) for r in runs], [_value(r, metric, p) for r in runs],
                    marker="o", label=target)
        ax.set_title(f"{metric.upper()} p{p:g}")
        ax.set_ylabel("ms")
        ax.grid(alpha=0.3)
    for ax in axes.flat:
        ax.set_xlim(left=0)
        ax.set_ylim(bottom=0)
    for ax in axes[1]:
        ax.set_xlabel("achieved request rate (req/s)")
    axes[0][0].legend()
    fig.suptitle(title(result), fontsize=9, wrap=True)
    fig.tight_layout()
    return _save(fig, plt, path)


def plot_throughput_vs_rate(result: BenchmarkResult, path: Path) -> Path:
    """Output tokens per second; with an SLA (--goodput), requests per second within it
    beside all of them."""
    plt = _pyplot()
    has_goodput = any(r.metrics.request_goodput is not None for r in result.runs)
    fig, axes = plt.subplots(1, 2 if has_goodput else 1, figsize=(10 if has_goodput else 6, 4),
                             squeeze=False)
    for target in _targets(result):
        runs = sorted((r for r in result.runs if r.target == target), key=_x)
        axes[0][0].plot([_x(r) for r in runs], [r.metrics.output_throughput for r in runs],
                        marker="o", label=target)
        if has_goodput:
            axes[0][1].plot([_x(r) for r in runs], [r.metrics.request_goodput or 0.0
                                                    for r in runs], marker="o", label=target)
    axes[0][0].set_title("output token throughput")
    axes[0][0].set_ylabel("tokens/s")
    if has_goodput:
        axes[0][1].set_title("goodput (requests within the SLA)")
        axes[0][1].set_ylabel("req/s")
    for ax in axes[0]:
        ax.set_xlabel("achieved request rate (req/s)")
        ax.set_xlim(left=0)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0][0].legend()
    fig.suptitle(title(result), fontsize=9, wrap=True)
    fig.tight_layout()
    return _save(fig, plt, path)


def plot_ttft_vs_itl(result: BenchmarkResult, path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 5))
    markers = "os^Dvx+*"
    rates = list(dict.fromkeys(run.request_rate for run in result.runs))
    for colour, target in enumerate(_targets(result)):
        for run in (r for r in result.runs if r.target == target):
            done = [r for r in run.records if r.is_success and r.itls_s]
            ax.scatter([r.ttft_s * 1000 for r in done],
                       [sum(r.itls_s) / len(r.itls_s) * 1000 for r in done], s=12, alpha=0.6,
                       color=f"C{colour}", marker=markers[rates.index(run.request_rate) % 8],
                       label=f"{target} @ {run.request_rate:g} req/s")
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("mean ITL of the request (ms)")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title(result), fontsize=9, wrap=True)
    fig.tight_layout()
    return _save(fig, plt, path)


def write_plots(result: BenchmarkResult, directory: Path) -> list[Path]:
    directory = Path(directory)
    return [plot_latency_vs_rate(result, directory / "latency_vs_rate.png"),
            plot_throughput_vs_rate(result, directory / "throughput_vs_rate.png"),
            plot_ttft_vs_itl(result, directory / "ttft_vs_itl.png")]
