"""A streaming client's inter-token latency beside attacks on the router's HTTP front.

One deployment (router with `--http-port`, 1 prefill + 1 decode worker) serves `--num-clients`
streaming clients, each sending completions of `--output-len` tokens (ignore_eos) one after
another for `--duration-s` seconds, first alone, then beside each attack, run from another
process so that the attack's own work never lands on the client's event loop:

  header     connections each sending a request head that never ends (`--header-mib` MiB of
             one header, 1 MiB at a time), one after another;
  half-open  `--half-open` connections holding an unfinished request head, each reopened as
             soon as the router closes it;
  messages   `--attack-bodies` clients posting, again and again, a 4 MB chat body of 262,000
             `{"role":"user"}` messages.

Each repetition runs the four phases (alone first, the attacks in a rotating order). Reported:
the client's p99 (and p50) ITL per phase, median [min-max] over repetitions; each attack's p99
ITL over the alone phase's, taken within each repetition (target: under 1.5); what the attacks
got (connections closed, answers by status) and the router's memory growth (its processes'
RSS, end of the phase over its start). Usage:

    .venv/bin/python bench/bench_http_attacks.py [--model tiny|default|PATH] [--repeats 3]
        [--duration-s 10] [--num-clients 2] [--output-len 64] [--half-open 1000]
        [--attack-bodies 2] [--header-mib 128] [--out bench/results/bench_http_attacks.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script too
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "kernels"))
from bench.bench_prefix_cache import Spread, spread  # noqa: E402
from deploy.default_model import BENCH_MODEL_HELP, bench_model  # noqa: E402
from deploy.launcher import Deployment  # noqa: E402
from kvferry.settings import DEPLOYMENT_TORCH_THREADS  # noqa: E402

ATTACKS = ("header", "half-open", "messages")
PHASES = ("alone", *ATTACKS)
TARGET_RATIO = 1.5  # p99 ITL beside an attack over alone, at most
NUM_ATTACK_MESSAGES = 262_000
PROMPT = "The quick brown fox jumps over the lazy dog. " * 4


class Phase(NamedTuple):
    """One phase of one repetition: the client's figures and what the attack got."""

    p50_itl_ms: float
    p99_itl_ms: float
    num_itls: int
    completed: int
    failed: int
    router_rss_growth_mib: float
    attack: dict[str, int]  # attack outcome counts (closed connections, answers by status)


# ---- the client --------------------------------------------------------------------------
def _percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def _stream_one(client: httpx.AsyncClient, output_len: int, itls: list[float]) -> bool:
    body = {"prompt": PROMPT, "max_tokens": output_len, "stream": True, "temperature": 0,
            "ignore_eos": True}
    last = None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            return False
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.perf_counter()
            if last is not None:
                itls.append(now - last)
            last = now
    return True


async def _clients(base_url: str, num_clients: int, output_len: int, duration_s: float
                   ) -> tuple[list[float], int, int]:
    itls: list[float] = []
    outcomes: Counter[bool] = Counter()
    end = time.monotonic() + duration_s

    async def one_client() -> None:
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
            while time.monotonic() < end:
                try:
                    outcomes[await _stream_one(client, output_len, itls)] += 1
                except httpx.HTTPError:
                    outcomes[False] += 1

    await asyncio.gather(*(one_client() for _ in range(num_clients)))
    return itls, outcomes[True], outcomes[False]


# ---- the attacks (run in a child process: `--attack NAME`) ------------------------------
async def _drain(reader: asyncio.StreamReader) -> None:
    try:
        while await reader.read(65536):
            pass
    except ConnectionError:
        pass


async def _header_attack(host: str, port: int, end: float, header_mib: int,
                         counts: Counter[str]) -> None:
    chunk = b"a" * (1 << 20)
    while time.monotonic() < end:
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Big: ")
        try:
            for _ in range(header_mib):
                writer.write(chunk)
                await writer.drain()
                counts["mib_sent"] += 1
            counts["heads_taken_whole"] += 1  # never closed: the server kept reading
        except ConnectionError:
            counts["connections_closed"] += 1
        writer.close()
        await asyncio.sleep(0.05)


async def _half_open_attack(host: str, port: int, end: float, num: int,
                            counts: Counter[str]) -> None:
    async def hold() -> None:
        while time.monotonic() < end:
            try:
                reader, writer = await asyncio.open_connection(host, port)
            except OSError:
                counts["connect_failed"] += 1
                await asyncio.sleep(0.1)
                continue
            writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n")
            try:
                await asyncio.wait_for(_drain(reader), max(0.0, end - time.monotonic()))
                counts["connections_closed"] += 1
            except TimeoutError:
                counts["open_at_end"] += 1
            writer.close()

    await asyncio.gather(*(hold() for _ in range(num)))


async def _messages_attack(host: str, port: int, end: float, num: int,
                           counts: Counter[str]) -> None:
    body = json.dumps({"messages": [{"role": "user"}] * NUM_ATTACK_MESSAGES},
                      separators=(",", ":")).encode()

    async def post() -> None:
        async with httpx.AsyncClient(base_url=f"http://{host}:{port}", timeout=60) as client:
            while time.monotonic() < end:
                try:
                    answer = await client.post("/v1/chat/completions", content=body,
                                               headers={"content-type": "application/json"})
                    counts[f"status_{answer.status_code}"] += 1
                except httpx.HTTPError:
                    counts["failed"] += 1

    await asyncio.gather(*(post() for _ in range(num)))


def run_attack(args: argparse.Namespace) -> int:
    """The child process: one attack for `--duration-s`, its counts printed as JSON."""
    host, port = args.address.rsplit(":", 1)
    counts: Counter[str] = Counter()
    end = time.monotonic() + args.duration_s
    attack = {"header": lambda: _header_attack(host, int(port), end, args.header_mib, counts),
              "half-open": lambda: _half_open_attack(host, int(port), end, args.half_open,
                                                     counts),
              "messages": lambda: _messages_attack(host, int(port), end, args.attack_bodies,
                                                   counts)}[args.attack]
    asyncio.run(attack())
    print(json.dumps(dict(counts)), flush=True)
    return 0


# ---- one deployment, the phases -------------------------------------------------------
def _rss_mib(pid: int) -> float:
    try:
        process = psutil.Process(pid)
        return sum(p.memory_info().rss for p in [process, *process.children(recursive=True)]
                   ) / 2**20
    except psutil.Error:
        return float("nan")


def run_phase(deployment: Deployment, args: argparse.Namespace, phase: str) -> Phase:
    address = deployment.http_address
    router_pid = deployment.processes[-1].popen.pid
    before = _rss_mib(router_pid)
    attacker = None
    if phase != "alone":
        attacker = subprocess.Popen(
            [sys.executable, __file__, "--attack", phase, "--address", address,
             "--duration-s", str(args.duration_s + 2), "--half-open", str(args.half_open),
             "--attack-bodies", str(args.attack_bodies), "--header-mib", str(args.header_mib)],
            stdout=subprocess.PIPE, text=True,
            preexec_fn=(lambda: os.nice(args.attacker_nice)) if args.attacker_nice else None)
        time.sleep(2.0)  # the attack under way before the client starts
    itls, completed, failed = asyncio.run(_clients(f"http://{address}", args.num_clients,
                                                   args.output_len, args.duration_s))
    growth = _rss_mib(router_pid) - before
    counts: dict[str, int] = {}
    if attacker is not None:
        out, _ = attacker.communicate(timeout=args.duration_s + 120)
        counts = json.loads(out.strip().splitlines()[-1]) if out.strip() else {}
    result = Phase(_percentile(itls, 50) * 1e3, _percentile(itls, 99) * 1e3, len(itls),
                   completed, failed, growth, counts)
    print(f"  {phase}: ITL p50 {result.p50_itl_ms:.2f} p99 {result.p99_itl_ms:.2f} ms over "
          f"{len(itls)} ITLs; {completed} done, {failed} failed; router RSS {growth:+.1f} MiB; "
          f"attack {counts}", flush=True)
    return result


def run_all(args: argparse.Namespace, model: str, log_dir: Path,
            running: Deployment | None = None) -> list[dict[str, Phase]]:
    """Every phase, against `running` (with its HTTP front; its router last) or a deployment
    started here."""
    deployment = running or Deployment(model=model, num_prefill=1, num_decode=1, http_port=0,
                                       torch_threads=args.torch_threads, log_dir=log_dir)
    repetitions = []
    with contextlib.nullcontext() if running else deployment:
        run_phase(deployment, args, "alone")  # warm-up, not reported
        for r in range(args.repeats):
            print(f"repetition {r + 1}", flush=True)
            shift = r % len(ATTACKS)
            order = ["alone", *ATTACKS[shift:], *ATTACKS[:shift]]
            repetitions.append({phase: run_phase(deployment, args, phase) for phase in order})
    return repetitions


# ---- report -------------------------------------------------------------------------------
def ratios(repetitions: Sequence[dict[str, Phase]], attack: str) -> list[float]:
    """p99 ITL beside `attack` over alone, within each repetition."""
    return [rep[attack].p99_itl_ms / rep["alone"].p99_itl_ms for rep in repetitions]


def summarize(repetitions: Sequence[dict[str, Phase]]) -> dict[str, Any]:
    out: dict[str, Any] = {"phases": {}, "ratios": {}, "target": {}}
    for phase in PHASES:
        out["phases"][phase] = {
            name: spread([getattr(rep[phase], name) for rep in repetitions])._asdict()
            for name in ("p50_itl_ms", "p99_itl_ms", "router_rss_growth_mib")}
    for attack in ATTACKS:
        values = ratios(repetitions, attack)
        out["ratios"][attack] = {**spread(values)._asdict(), "values": values}
        out["target"][attack] = {"ratio_below": TARGET_RATIO,
                                 "is_met": out["ratios"][attack]["median"] < TARGET_RATIO}
    return out


def format_report(repetitions: Sequence[dict[str, Phase]]) -> str:
    summary = summarize(repetitions)
    lines = ["| phase | p50 ITL (ms) | p99 ITL (ms) | router RSS growth (MiB) | p99 / alone |",
             "|---|---:|---:|---:|---:|"]
    for phase in PHASES:
        cells = [Spread(**summary["phases"][phase][name]).text()
                 for name in ("p50_itl_ms", "p99_itl_ms", "router_rss_growth_mib")]
        r = summary["ratios"].get(phase)
        cells.append("-" if r is None else Spread(r["median"], r["low"], r["high"]).text(3))
        lines.append(f"| {phase} | " + " | ".join(cells) + " |")
    for attack in ATTACKS:
        verdict = "met" if summary["target"][attack]["is_met"] else "NOT met"
        lines.append(f"target ({attack}: p99 ITL / alone < {TARGET_RATIO}): {verdict}")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help=BENCH_MODEL_HELP)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--duration-s", type=float, default=10.0, help="per phase")
    p.add_argument("--num-clients", type=int, default=2, help="streaming clients")
    p.add_argument("--output-len", type=int, default=64, help="tokens per request")
    p.add_argument("--half-open", type=int, default=1000, help="connections held half-open")
    p.add_argument("--attack-bodies", type=int, default=2,
                   help="clients posting the 262,000-message body")
    p.add_argument("--header-mib", type=int, default=128, help="MiB of one unending header")
    p.add_argument("--torch-threads", type=int, default=DEPLOYMENT_TORCH_THREADS)
    p.add_argument("--attacker-nice", type=int, default=0,
                   help="run the attacking process at this nice value (19: it takes only CPU "
                        "the deployment leaves, standing in for an attacker on another host)")
    p.add_argument("--out", type=Path, default=None, help="write the JSON here")
    p.add_argument("--log-dir", type=Path, default=None)
    p.add_argument("--attack", choices=ATTACKS, default=None, help=argparse.SUPPRESS)
    p.add_argument("--address", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.repeats < 1 or args.num_clients < 1 or args.duration_s <= 0:
        p.error("--repeats, --num-clients and --duration-s must be positive")
    return args


def payload(args: argparse.Namespace, model: str, argv: Sequence[str],
            repetitions: list[dict[str, Phase]]) -> dict[str, Any]:
    skipped = {"out", "log_dir", "attack", "address"}
    return {"date": datetime.date.today().isoformat(),
            "command": shlex.join([".venv/bin/python", "bench/bench_http_attacks.py", *argv]),
            "checkpoint": Path(model).name, "machine": platform.platform(),
            "args": {k: v for k, v in vars(args).items() if k not in skipped},
            "deployment": "router (--http-port 0, default limits) + 1 prefill + 1 decode",
            "summary": summarize(repetitions),
            "repetitions": [{phase: result._asdict() for phase, result in rep.items()}
                            for rep in repetitions]}


def main(argv: Sequence[str] | None = None, running: Deployment | None = None) -> int:
    """The command; `running`: a deployment to measure instead of starting one (from Python:
    the test suite points it at a shared deployment)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.attack is not None:
        return run_attack(args)
    model = bench_model(args.model)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="bench_http_attacks-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"model {args.model} ({Path(model).name}); logs {log_dir}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds: the deployment stops
    try:
        repetitions = run_all(args, model, log_dir, running)
    except (RuntimeError, ValueError) as exc:
        print(f"bench_http_attacks: {exc} (logs: {log_dir})", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bench_http_attacks: interrupted; deployment stopped", file=sys.stderr)
        return 130
    print(format_report(repetitions))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(payload(args, model, argv, repetitions), indent=1) + "\n")
        print(f"results: {args.out}")
    failed = sum(phase.failed for rep in repetitions for phase in rep.values())
    if failed:
        print(f"bench_http_attacks: {failed} client requests failed (see {log_dir})",
              file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
