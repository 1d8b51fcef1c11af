"""`kvferry plan` reproduces the reference K/V sizes (issue 5, acceptance 4)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deploy.cli import main
from kvferry.cache.capacity import plan
from kvferry.cache.layout import KvShape, blocks_needed

LLAMA3_8B = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
             "hidden_size": 4096}
QWEN3_4B = {"num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "hidden_size": 2560}


def test_llama3_8b_bf16() -> None:
    shape = KvShape(32, 8, 128, "bfloat16")
    assert shape.bytes_per_token == 131_072
    assert plan(shape, 1000, 0, 1, 1 << 30, 16).bytes_per_request == 131_072_000
    assert plan(shape, 8000, 0, 1, 1 << 30, 16).bytes_per_request == 1_048_576_000


def test_qwen3_4b_bf16() -> None:
    shape = KvShape(36, 8, 128, "bfloat16")
    assert shape.bytes_per_token == 147_456
    assert plan(shape, 100, 0, 1, 1 << 30, 16).bytes_per_request == 14_745_600


def test_requests_that_fit_count_whole_blocks() -> None:
    shape = KvShape(2, 1, 4, "float32")  # 64 bytes a token
    result = plan(shape, prompt_tokens=17, output_tokens=15, batch=3, pool_bytes=64 * 16 * 10,
                  block_size=16)
    assert result.blocks_per_request == 2 == blocks_needed(17, 15, 16)
    assert result.pool_blocks == 10 and result.requests_that_fit == 5
    assert result.bytes_for_batch == 3 * 32 * 64


@pytest.mark.parametrize("config,args,expected", [
    (LLAMA3_8B, ["--prompt-tokens", "1000"], ["bytes per token: 131,072",
                                               "131,072,000 bytes"]),
    (QWEN3_4B, ["--prompt-tokens", "100"], ["bytes per token: 147,456", "14,745,600 bytes"]),
])
def test_plan_command_reads_config_json(config: dict, args: list[str], expected: list[str],
                                        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert main(["plan", "--model", str(path), "--dtype", "bfloat16", *args]) == 0
    out = capsys.readouterr().out
    for text in expected:
        assert text in out


def test_plan_command_reads_a_checkpoint(qwen3_checkpoint: Path,
                                         capsys: pytest.CaptureFixture) -> None:
    assert main(["plan", "--model", str(qwen3_checkpoint), "--dtype", "float32",
                 "--prompt-tokens", "10", "--pool-size", "256MiB"]) == 0
    # 4 layers x 2 kv heads x 64 x 4 bytes x 2 = 4,096 bytes a token; 256 MiB = 4,096 blocks.
    out = capsys.readouterr().out
    assert "bytes per token: 4,096" in out and "pool holds 4,096 blocks" in out


def test_bad_dtype_is_named() -> None:
    with pytest.raises(ValueError, match="dtype"):
        KvShape(1, 1, 1, "float64")
