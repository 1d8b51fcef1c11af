"""A tensor-parallel worker's ranks (kvferry/model/tp_group.py): rank 0 here, the others
processes it starts. Calls made on rank 0 run on every rank; greedy tokens equal the whole
model's; a rank that dies fails the next call with RankLost, and closing leaves no rank
behind."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from kvferry.model.config import load_model_config
from kvferry.model.tp_group import RankLost, RankSpec, TensorParallelModel
from kvferry.model.transformer import Transformer
from kvferry_kernels.dispatch import get_attention_backend
from tests.kvferry.model.greedy_split import greedy, pool_of


def _spec(checkpoint: Path) -> RankSpec:
    return RankSpec(str(checkpoint), "auto", "torch", "float32", block_size=16, num_blocks=64)


def test_calls_on_rank_zero_decode_as_the_whole_model(qwen3_checkpoint: Path) -> None:
    config = load_model_config(qwen3_checkpoint)
    whole = Transformer(config, get_attention_backend("torch"))
    expected, expected_logits = greedy(whole, pool_of(whole))
    group = TensorParallelModel(_spec(qwen3_checkpoint), 2)
    try:
        assert group.pool.num_kv_heads == 1  # rank 0's half of the 2 K/V heads
        tokens, logits = greedy(group, group.pool)
        assert tokens == expected
        torch.testing.assert_close(logits, expected_logits, atol=1e-4, rtol=1e-4)
    finally:
        group.close()
    assert not any(p.is_alive() for p in group.ranks)


def test_a_rank_killed_fails_the_next_call_and_close_still_ends_the_rest(
        qwen3_checkpoint: Path) -> None:
    group = TensorParallelModel(_spec(qwen3_checkpoint), 4)
    try:
        os.kill(group.ranks[1].pid, signal.SIGKILL)  # rank 2 of 4
        group.ranks[1].join(10)
        start = time.monotonic()
        with pytest.raises(RankLost, match="tp-rank-2"):
            greedy(group, group.pool)
        assert time.monotonic() - start < 30  # its connection closed: not the timeout
    finally:
        group.close()
    assert not any(p.is_alive() for p in group.ranks)
    with pytest.raises(RankLost, match="closed"):
        group.prefill(torch.tensor([1]), [1], torch.tensor([0]), group.pool)
