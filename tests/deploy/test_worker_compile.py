"""How a worker compiles its forwards (deploy/worker_model.compile_forwards): --compile
dynamic, the default, on every role; the bucket modes on decode and colocated workers only;
eager, with the reason in the log, where the build fails. The compiled forwards' tokens:
tests/kvferry/model/test_compiled_dynamic.py and the token-exact deployments."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from deploy import worker_model
from deploy.worker_model import build_model
from kvferry.model import compiled
from kvferry.settings import WorkerSettings


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """compile_model recorded instead of run: (mode, the model's class) per call."""
    seen: list[tuple[str, str]] = []

    def record(model: object, mode: str, *args: object, **kwargs: object) -> None:
        seen.append((mode, type(model).__name__))

    monkeypatch.setattr(compiled, "compile_model", record)
    return seen


def _settings(checkpoint: Path, role: str, mode: str) -> WorkerSettings:
    return WorkerSettings(role=role, model=str(checkpoint), kv_pool_size="1MiB",
                          dtype="float32", device="cpu", compile=mode)


@pytest.mark.parametrize("role", ["prefill", "decode", "colocated"])
def test_dynamic_compiles_every_role(role: str, qwen3_checkpoint: Path,
                                     calls: list[tuple[str, str]]) -> None:
    build_model(_settings(qwen3_checkpoint, role, "dynamic"))
    assert calls == [("dynamic", "Transformer")]


@pytest.mark.parametrize(("role", "compiles"), [("prefill", False), ("decode", True)])
def test_a_bucket_mode_compiles_the_decode_step_only(role: str, compiles: bool,
                                                     qwen3_checkpoint: Path,
                                                     calls: list[tuple[str, str]]) -> None:
    build_model(_settings(qwen3_checkpoint, role, "default"))
    assert calls == ([("default", "Transformer")] if compiles else [])


def test_off_compiles_nothing(qwen3_checkpoint: Path, calls: list[tuple[str, str]]) -> None:
    model, _, _ = build_model(_settings(qwen3_checkpoint, "decode", "off"))
    assert calls == [] and model.compiled is None


def test_a_failed_build_serves_eager_and_says_why(qwen3_checkpoint: Path,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    def fail(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(compiled, "compile_model", fail)
    with caplog.at_level(logging.WARNING, logger=worker_model.log.name):
        model, _, _ = build_model(_settings(qwen3_checkpoint, "decode", "dynamic"))
    assert model.compiled is None
    assert ("forwards eager: compiling the model failed (RuntimeError: no C++ compiler found)"
            in caplog.text)
