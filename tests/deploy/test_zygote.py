"""deploy/zygote.py: servers forked from a process that imported torch once run as a fresh
`python -m deploy.cli` would (their own session, the caller's environment, working directory,
stdout and stderr), report their exit codes and signals as `subprocess.Popen` does, and the
launcher falls back to a fresh interpreter once the zygote is gone."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy import zygote
from deploy.start_log import START_LOG_ENV
from kvferry.rpc.grpc_util import parse_ready


@pytest.fixture
def own_zygote(monkeypatch: pytest.MonkeyPatch) -> Iterator[subprocess.Popen[bytes]]:
    """A zygote of this test's own (not the run's), stopped by closing its stdin."""
    monkeypatch.delenv(zygote.ZYGOTE_ENV, raising=False)
    started = zygote.start()
    assert started is not None
    yield started
    assert started.stdin is not None
    started.stdin.close()  # a second close (a test closed it) does nothing
    assert started.wait(30) == 0


def _ready_line(process: zygote.ZygoteProcess) -> str:
    for line in process.stdout:
        if parse_ready(line) is not None:
            return line
    raise AssertionError(f"no ready line; exit code {process.wait(30)}")


def test_a_forked_worker_runs_in_its_own_session_with_the_callers_environment(
        own_zygote: subprocess.Popen[bytes], qwen3_checkpoint: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "model").symlink_to(qwen3_checkpoint)
    monkeypatch.chdir(tmp_path)  # the relative --model below resolves here
    starts = tmp_path / "starts.log"
    env = {**os.environ, START_LOG_ENV: str(starts), "PYTEST_CURRENT_TEST": "zygote-env"}
    with open(tmp_path / "worker.log", "a") as stderr:
        worker = zygote.spawn(["prefill-worker", "--model", "model", "--kv-pool-size",
                               "64MiB"], env, stderr)
    assert isinstance(worker, zygote.ZygoteProcess)
    try:
        assert _ready_line(worker)  # on the stdout pipe
        assert os.getsid(worker.pid) == worker.pid  # a session of its own
        assert worker.poll() is None
        assert starts.read_text().endswith("\tzygote-env\n")  # its environment, not ours
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(60) == 0  # drained and exited, as from a fresh interpreter
    finally:
        if worker.poll() is None:
            worker.kill()
    assert "prefill worker" in (tmp_path / "worker.log").read_text().lower()  # its stderr


def test_exit_codes_and_signals_come_back_as_from_popen(
        own_zygote: subprocess.Popen[bytes], qwen3_checkpoint: Path, tmp_path: Path) -> None:
    with open(tmp_path / "bad.log", "a") as stderr:
        bad = zygote.spawn(["plan", "--layers", "zero"], dict(os.environ), stderr)
    assert bad is not None
    assert bad.wait(60) == 2  # one line and exit code 2, as the command line promises
    assert "--layers" in (tmp_path / "bad.log").read_text()
    with pytest.raises(subprocess.TimeoutExpired):
        zygote.ZygoteProcess.wait(worker := _spawned(qwen3_checkpoint), 0.01)
    worker.kill()
    assert worker.wait(30) == -signal.SIGKILL
    worker.kill()  # gone: nothing is sent (its pid may be another process's by now)


@pytest.mark.parametrize(("how", "status", "stderr"), [
    ("none", 0, ""), ("3", 3, ""), ("a message", 1, "a message"),
    ("raise", 1, "RuntimeError: probe failed"), ("interrupt", -signal.SIGINT, "KeyboardInterrupt")])
def test_a_forked_child_ends_as_the_interpreter_would(
        own_zygote: subprocess.Popen[bytes], tmp_path: Path, how: str, status: int,
        stderr: str) -> None:
    """Without tearing down its modules (deploy/zygote.py `_run_child`), a child still ends
    as a fresh interpreter would: threading's exit hooks wake an idle thread pool's worker
    (else the join waits forever), atexit handlers run and stdout is flushed, and the status
    is SystemExit's (a message: printed, 1), 1 after an exception, SIGINT after a Ctrl-C."""
    with open(tmp_path / "err", "w+") as err:
        child = zygote.spawn([how], dict(os.environ), err, module="tests.deploy.zygote_exit_probe")
        assert child is not None
        try:
            assert child.wait(30) == status
        finally:
            child.kill()  # (one that hangs at exit)
        out = child.stdout.read()
        err.seek(0)
        assert stderr in err.read()
    assert out == "pool ran\natexit ran\n"


def _spawned(checkpoint: Path) -> zygote.ZygoteProcess:
    worker = zygote.spawn(["prefill-worker", "--model", str(checkpoint), "--kv-pool-size",
                           "64MiB"], dict(os.environ), None)
    assert worker is not None
    _ready_line(worker)
    return worker


def test_without_a_zygote_the_launcher_starts_a_fresh_interpreter(
        own_zygote: subprocess.Popen[bytes]) -> None:
    assert own_zygote.stdin is not None
    own_zygote.stdin.close()
    assert own_zygote.wait(30) == 0  # it exits with the process that started it
    assert zygote.spawn(["plan"], dict(os.environ), None) is None


def test_a_tensor_parallel_rank_is_forked_and_its_loss_is_heard(
        own_zygote: subprocess.Popen[bytes], qwen3_checkpoint: Path) -> None:
    """A split worker's ranks 1..N-1 come from the zygote (torch imported already), in a
    session of their own; the group computes with them as with spawned ones, and one killed
    is heard by the group's watch at once, as multiprocessing's sentinel would tell it."""
    import threading

    from kvferry.model.config import load_model_config
    from kvferry.model.tp_group import RankSpec, TensorParallelModel
    from kvferry.model.transformer import Transformer
    from kvferry_kernels.dispatch import get_attention_backend
    from tests.kvferry.model.greedy_split import greedy, pool_of

    whole = Transformer(load_model_config(qwen3_checkpoint), get_attention_backend("torch"))
    expected, _ = greedy(whole, pool_of(whole))
    spec = RankSpec(str(qwen3_checkpoint), "auto", "torch", "float32", block_size=16,
                    num_blocks=64)
    group = TensorParallelModel(spec, 2, zygote.start_rank)
    lost = threading.Event()
    group.on_lost = lambda error: lost.set()
    try:
        (rank,) = group.ranks
        assert isinstance(rank, zygote.ZygoteRank) and rank.name == "tp-rank-1"
        assert rank.is_alive() and os.getsid(rank.pid) == rank.pid
        assert greedy(group, group.pool)[0] == expected  # both ranks computed their halves
        os.kill(rank.pid, signal.SIGKILL)
        assert lost.wait(30)  # the watch woke on the rank's exit, with no call under way
        assert not rank.is_alive() and rank.exitcode == -signal.SIGKILL
        sentinel = str(rank.sentinel)
    finally:
        group.close()
    assert sentinel in os.listdir("/proc/self/fd")
    del group, rank
    gc.collect()
    assert sentinel not in os.listdir("/proc/self/fd")  # closed with the rank: none kept


def test_without_a_zygote_a_rank_is_spawned(monkeypatch: pytest.MonkeyPatch,
                                             qwen3_checkpoint: Path) -> None:
    import multiprocessing as mp

    from kvferry.model.tp_group import RankSpec, TensorParallelModel

    monkeypatch.setenv(zygote.ZYGOTE_ENV, "off")
    spec = RankSpec(str(qwen3_checkpoint), "auto", "torch", "float32", block_size=16,
                    num_blocks=64)
    group = TensorParallelModel(spec, 2, zygote.start_rank)
    try:
        assert isinstance(group.ranks[0], mp.process.BaseProcess)
    finally:
        group.close()
    assert not group.ranks[0].is_alive()
