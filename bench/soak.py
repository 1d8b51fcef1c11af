"""Soak: a bounded run of concurrent clients with mixed lengths, cancels and aborts against a
local deployment. Reports request outcomes, whether every pool came back to all free, and the
resident memory (VmRSS) of every process after a warm-up and at the end.

Each client loops until the time is up: 70% short requests (8-48 prompt and output tokens),
30% long ones (150-400 prompt, 100-200 output); greedy or seeded sampling; 15% cancelled by
the client and 10% aborted through the Abort RPC, at a random moment. Usage:

    .venv/bin/python bench/soak.py [--duration-s 180] [--warmup-s 30] [--concurrency 16]
                                   [--out FILE]

tests/e2e/test_soak.py runs a short version (`run_soak`) against a deployment of its own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc

from decode_worker.kv_stage import HOLD_S
from deploy import client
from deploy.launcher import Deployment
from kvferry.rpc import grpc_util
from kvferry.v1 import generation_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc

CANCEL_FRACTION = 0.15
ABORT_FRACTION = 0.10


@dataclass
class Outcomes:
    """How the requests of one soak phase ended."""

    num_requests: int = 0
    num_completed: int = 0  # full stream, the exact number of tokens asked for
    num_cancelled: int = 0  # cancelled by the client
    num_aborted: int = 0  # finish reason ABORT after an Abort RPC
    num_tokens: int = 0
    unexpected: list[str] = field(default_factory=list)  # anything else, described


@dataclass
class ProcessMemory:
    name: str
    rss_after_warmup_kib: int
    rss_end_kib: int

    @property
    def growth(self) -> float:
        return self.rss_end_kib / self.rss_after_warmup_kib - 1.0


@dataclass
class SoakReport:
    warmup_s: float
    duration_s: float
    concurrency: int
    warmup: Outcomes
    soak: Outcomes
    memory: list[ProcessMemory]
    pools_free: bool
    pool_problems: list[str]


def rss_kib(pid: int) -> int:
    """Resident set size of a live process, from /proc/PID/status."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def _plan(rng: random.Random) -> tuple[generation_pb2.GenerateRequest, str, float]:
    """A request, its fate ("finish", "cancel" or "abort") and when that fate strikes."""
    if rng.random() < 0.3:
        prompt_len, max_tokens = rng.randint(150, 400), rng.randint(100, 200)
    else:
        prompt_len, max_tokens = rng.randint(8, 48), rng.randint(8, 48)
    sampling = ({"temperature": 0.0} if rng.random() < 0.5
                else {"temperature": 0.8, "top_p": 0.9, "seed": rng.randrange(1 << 32)})
    request = client.make_request([rng.randint(1, 500) for _ in range(prompt_len)],
                                  f"soak-{rng.randrange(1 << 60):x}", max_tokens=max_tokens,
                                  ignore_eos=True, **sampling)
    roll = rng.random()
    fate = ("cancel" if roll < CANCEL_FRACTION
            else "abort" if roll < CANCEL_FRACTION + ABORT_FRACTION else "finish")
    return request, fate, rng.uniform(0.0, 1.0)


async def _one(stub: generation_pb2_grpc.GenerationServiceStub, rng: random.Random,
               out: Outcomes) -> None:
    request, fate, after_s = _plan(rng)
    out.num_requests += 1

    task = asyncio.ensure_future(client.collect(stub, request, timeout_s=120))
    if fate != "finish":
        done, _ = await asyncio.wait({task}, timeout=after_s)
        if not done and fate == "cancel":
            task.cancel()
        elif not done:
            try:
                await stub.Abort(generation_pb2.AbortRequest(request_id=request.request_id),
                                 timeout=30)
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.NOT_FOUND:  # NOT_FOUND: it just finished
                    out.unexpected.append(f"Abort: {exc.code().name}: {exc.details()}")
    try:
        got = await task
    except asyncio.CancelledError:
        out.num_cancelled += 1
        return
    except grpc.aio.AioRpcError as exc:
        out.unexpected.append(f"Generate: {exc.code().name}: {exc.details()}")
        return
    out.num_tokens += len(got.token_ids)
    reason = got.finished.reason if got.finished else None
    if reason == generation_pb2.FINISH_REASON_ABORT and fate == "abort":
        out.num_aborted += 1
    elif (reason == generation_pb2.FINISH_REASON_LENGTH
          and len(got.token_ids) == request.sampling.max_tokens):
        out.num_completed += 1
    else:
        out.unexpected.append(f"finished {reason} with {len(got.token_ids)} of "
                              f"{request.sampling.max_tokens} tokens")


async def soak(address: str, duration_s: float, concurrency: int, seed: int) -> Outcomes:
    """`concurrency` closed-loop clients for `duration_s`; each finishes its last request."""
    out = Outcomes()
    stop_at = time.monotonic() + duration_s

    async def loop(rng: random.Random) -> None:
        while time.monotonic() < stop_at:
            await _one(stub, rng, out)

    async with grpc_util.channel(address) as chan:
        stub = generation_pb2_grpc.GenerationServiceStub(chan)
        await asyncio.gather(*(loop(random.Random(seed * 1000 + i))
                               for i in range(concurrency)))
    return out


def pool_problems(deployment: Deployment, timeout_s: float = 10.0) -> list[str]:
    """Workers whose pool is not all free and idle (or fails its integrity check), after
    giving in-flight releases up to `timeout_s` to land. Empty: all clean."""
    deadline = time.monotonic() + timeout_s
    while True:
        problems = []
        for role in ("prefill", "decode"):
            for address in deployment.addresses(role):
                with grpc.insecure_channel(address, options=grpc_util.CHANNEL_OPTIONS) as chan:
                    stub = (worker_pb2_grpc.PrefillServiceStub(chan) if role == "prefill"
                            else worker_pb2_grpc.DecodeServiceStub(chan))
                    s = stub.GetStats(worker_pb2.GetStatsRequest(check_integrity=True),
                                      timeout=10)
                if not (s.integrity_ok and s.free_blocks == s.total_blocks
                        and s.num_running == 0 and s.num_waiting == 0):
                    problems.append(f"{role} {address}: {s.free_blocks}/{s.total_blocks} free, "
                                    f"{s.num_running} running, {s.num_waiting} waiting, "
                                    f"integrity {s.integrity_error or 'ok'}")
        if not problems or time.monotonic() > deadline:
            return problems
        time.sleep(0.1)


def run_soak(deployment: Deployment, warmup_s: float, duration_s: float, concurrency: int,
             seed: int = 0) -> SoakReport:
    """Warm up, take every process's RSS, soak, take it again (both with the load over, and
    once the decode stage's hold has run out: an idle stage keeps its rows HOLD_S for the
    next batch)."""
    warm = asyncio.run(soak(deployment.router_address, warmup_s, concurrency, seed))
    pool_problems(deployment)  # releases landed: a quiet moment to measure
    time.sleep(HOLD_S + 1.0)
    base = {p.name: rss_kib(p.popen.pid) for p in deployment.processes}
    out = asyncio.run(soak(deployment.router_address, duration_s, concurrency, seed + 1))
    problems = pool_problems(deployment)
    time.sleep(HOLD_S + 1.0)
    memory = [ProcessMemory(p.name, base[p.name], rss_kib(p.popen.pid))
              for p in deployment.processes]
    return SoakReport(warmup_s, duration_s, concurrency, warm, out, memory, not problems,
                      problems)


def _print(report: SoakReport) -> None:
    s = report.soak
    print(f"soak {report.duration_s:.0f} s after {report.warmup_s:.0f} s warm-up, "
          f"{report.concurrency} clients: {s.num_requests} requests, {s.num_completed} "
          f"completed, {s.num_cancelled} cancelled, {s.num_aborted} aborted, "
          f"{len(s.unexpected)} unexpected, {s.num_tokens} tokens")
    print(f"pools all free: {report.pools_free} {report.pool_problems or ''}")
    print(f"{'process':<12}{'RSS warm MiB':>14}{'RSS end MiB':>13}{'growth':>9}")
    for m in report.memory:
        print(f"{m.name:<12}{m.rss_after_warmup_kib / 1024:>14.1f}"
              f"{m.rss_end_kib / 1024:>13.1f}{m.growth:>9.2%}")


def main() -> None:
    from deploy.default_model import tiny_model

    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--duration-s", type=float, default=180.0)
    parser.add_argument("--warmup-s", type=float, default=30.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--num-prefill", type=int, default=1)
    parser.add_argument("--num-decode", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--log-dir", type=Path, default=None,
                        help="process logs (default: a new temporary directory)")
    args = parser.parse_args()
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="kvferry-soak-"))
    print(f"process logs in {log_dir}")
    with Deployment(model=args.model or tiny_model(), num_prefill=args.num_prefill,
                    num_decode=args.num_decode, log_dir=log_dir) as deployment:
        report = run_soak(deployment, args.warmup_s, args.duration_s, args.concurrency,
                          args.seed)
        dead = deployment.dead()
    _print(report)
    print(f"processes that died: {dead or 'none'}")
    if args.out:
        data = asdict(report)
        for m, entry in zip(report.memory, data["memory"]):
            entry["growth"] = m.growth
        data["dead"] = dead
        args.out.write_text(json.dumps(data, indent=2) + "\n")


if __name__ == "__main__":
    main()
