"""bench/bench_step_parts.py: the linear layers it times are exactly the model's, and every
backend it times computes the same product."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from bench.bench_step_parts import _linear_runners, linear_shapes, parse_args
from kvferry.model.config import load_model_config
from kvferry.model.transformer import Transformer
from kvferry_kernels.dispatch import get_attention_backend


def test_linear_shapes_are_the_loaded_models(qwen3_checkpoint: Path) -> None:
    config = load_model_config(qwen3_checkpoint)
    model = Transformer(config, get_attention_backend("torch"))
    loaded = Counter(tuple(w.shape) for name, w in model.weights.items()
                     if name.endswith("_proj.weight") or name == "lm_head.weight")
    timed: Counter[tuple[int, int]] = Counter()
    for out_features, in_features, count in linear_shapes(config):
        timed[out_features, in_features] += count  # shapes may coincide (qkv and LM head)
    assert loaded == timed


@pytest.mark.parametrize("batch", [1, 8])
def test_every_linear_backend_computes_the_same_product(batch: int) -> None:
    torch.manual_seed(0)
    weight, x = torch.randn(96, 64), torch.randn(batch, 64)
    expected = x @ weight.T
    for name, run in _linear_runners(weight, batch).items():
        torch.testing.assert_close(run(x), expected, rtol=1e-4, atol=1e-4, msg=name)


def test_bad_arguments_exit_2() -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--threads", "0"])
    assert exit_info.value.code == 2
