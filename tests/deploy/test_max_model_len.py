"""`--max-model-len`: a decode worker whose pool cannot hold one request of
the length asked for refuses to start in one line with exit status 2; without the flag the
length is the model's context, lowered (and logged) to what the pool holds; `serve` forwards
it to every worker; a decode engine refuses a reservation longer than it."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
from pathlib import Path

import pytest
import torch

from decode_worker.engine import DecodeEngine
from deploy import cli, zygote
from deploy.args import build_parser, worker_settings
from deploy.worker_model import max_model_len_for
from kvferry.cache.layout import KvLayout
from kvferry.cache.pool import KvPool
from kvferry.errors import InvalidArgument
from kvferry.model.config import load_model_config
from kvferry.model.transformer import Transformer
from kvferry.settings import WorkerSettings
from kvferry_kernels.dispatch import get_attention_backend

REPO = Path(__file__).resolve().parents[2]
# The seeded Qwen3 checkpoint on CPU: 64 KiB a 16-token block (float32), context 4096.
CONTEXT = 4096


def run_cli(argv: list[str], home: Path) -> subprocess.CompletedProcess:
    """The command forked by the run's zygote (a fresh interpreter without one)."""
    return zygote.run(argv, {**os.environ, "KVFERRY_HOME": str(home)}, REPO, 120)


def one_line(result: subprocess.CompletedProcess) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and lines[0].startswith("kvferry: "), result.stderr
    return lines[0]


@pytest.mark.parametrize("command", ["decode-worker", "colocated-worker", "serve"])
def test_a_pool_short_of_max_model_len_refuses_to_start(command: str, qwen3_checkpoint: Path,
                                                        tmp_path: Path) -> None:
    line = one_line(run_cli([command, "--model", str(qwen3_checkpoint), "--kv-pool-size", "1MiB",
                           "--max-model-len", str(CONTEXT), "--port", "0"], tmp_path))
    assert line == ("kvferry: kv_pool_size: the pool holds 256 tokens, less than one request "
                    f"of max_model_len {CONTEXT}; raise --kv-pool-size or lower "
                    "--max-model-len")


def test_max_model_len_past_the_context_or_below_one_is_refused(qwen3_checkpoint: Path,
                                                                 tmp_path: Path) -> None:
    line = one_line(run_cli(["decode-worker", "--model", str(qwen3_checkpoint),
                           "--max-model-len", str(CONTEXT + 1)], tmp_path))
    assert "max_model_len" in line and f"context of {CONTEXT}" in line
    line = one_line(run_cli(["decode-worker", "--model", str(qwen3_checkpoint),
                           "--max-model-len", "0"], tmp_path))
    assert "max_model_len" in line


def test_the_default_is_the_context_or_what_the_pool_holds(
        qwen3_checkpoint: Path, caplog: pytest.LogCaptureFixture) -> None:
    config = load_model_config(qwen3_checkpoint)

    def settings(**kwargs: object) -> WorkerSettings:
        return WorkerSettings(role="decode", model=str(qwen3_checkpoint), device="cpu",
                              **kwargs)  # type: ignore[arg-type]

    with caplog.at_level(logging.INFO, logger="kvferry.worker"):
        assert max_model_len_for(settings(kv_pool_size="1MiB"), config) == 256
    assert "max_model_len: 256 tokens" in caplog.text and "--max-model-len" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kvferry.worker"):
        assert max_model_len_for(settings(kv_pool_size="512MiB"), config) == CONTEXT
    assert not caplog.records
    assert max_model_len_for(settings(kv_pool_size="1MiB", max_model_len=200), config) == 200


def test_the_flag_reaches_worker_settings_and_serve_forwards_it() -> None:
    args = build_parser().parse_args(["decode-worker", "--model", "m", "--max-model-len", "512"])
    assert worker_settings(args).max_model_len == 512
    assert worker_settings(build_parser().parse_args(
        ["decode-worker", "--model", "m"])).max_model_len is None
    args = build_parser().parse_args(["serve", "--model", "m", "--max-model-len", "512"])
    worker_args = cli._deployment(args).worker_args
    assert worker_args[worker_args.index("--max-model-len") + 1] == "512"
    args = build_parser().parse_args(["serve", "--model", "m"])
    assert "--max-model-len" not in cli._deployment(args).worker_args


def test_the_decode_engine_refuses_a_reservation_past_max_model_len(
        qwen3_checkpoint: Path) -> None:
    config = load_model_config(qwen3_checkpoint)
    model = Transformer(config, get_attention_backend("torch"), torch.float32,
                        torch.device("cpu"))
    pool = KvPool(config.num_layers, config.num_kv_heads, config.head_dim, 16, 64,
                  torch.float32, torch.device("cpu"))
    engine = DecodeEngine(model, pool, KvLayout.of_pool(pool, config.fingerprint),
                          max_model_len=100)
    try:
        with pytest.raises(InvalidArgument) as exc:
            asyncio.run(engine.reserve("a", 60, 41, 30.0))
        assert exc.value.field == "max_tokens" and "context of 100" in str(exc.value)
        asyncio.run(engine.reserve("b", 60, 40, 30.0))  # exactly max_model_len
    finally:
        engine.steps.executor.shutdown(wait=True)
