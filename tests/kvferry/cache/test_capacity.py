"""`kvferry plan` reproduces the reference K/V sizes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deploy.cli import main
from kvferry.cache.budget import blocks_needed
from kvferry.cache.capacity import plan
from kvferry.cache.layout import KvShape

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


@pytest.mark.parametrize(("size", "heads", "per_token"), [(2, 1, 2048), (4, 1, 2048)])
def test_plan_counts_one_rank_of_a_split_worker(qwen3_checkpoint: Path, size: int,
                                                heads: int, per_token: int,
                                                capsys: pytest.CaptureFixture) -> None:
    """--tensor-parallel-size: one rank's K/V heads (2 split 2 ways: 1 each; 4 ways: each
    head on two ranks), so the same pool holds that many more blocks, as the worker's."""
    assert main(["plan", "--model", str(qwen3_checkpoint), "--dtype", "float32",
                 "--prompt-tokens", "10", "--pool-size", "256MiB",
                 "--tensor-parallel-size", str(size)]) == 0
    out = capsys.readouterr().out
    assert f"each rank holds {heads} of the 2 K/V heads" in out
    assert f"bytes per token: {per_token:,}" in out
    assert f"pool holds {(256 << 20) // (per_token * 16):,} blocks" in out


def test_plan_refuses_a_size_that_does_not_split_the_heads(
        qwen3_checkpoint: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["plan", "--model", str(qwen3_checkpoint), "--tensor-parallel-size",
                 "3"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == ("kvferry: tensor_parallel_size: 3 must divide the 2 K/V heads or "
                           "be a multiple of them")


def test_plan_sizes_each_tier(qwen3_checkpoint: Path, capsys: pytest.CaptureFixture) -> None:
    """Host blocks are bare (64 KiB here); disk files and store values add a 64-byte header."""
    assert main(["plan", "--model", str(qwen3_checkpoint), "--dtype", "float32",
                 "--prompt-tokens", "100", "--host-cache-size", "64MiB",
                 "--disk-cache-size", "1GiB", "--store-size", "65600B"]) == 0
    out = capsys.readouterr().out
    # 100 tokens: 7 blocks a request
    assert "host tier 0.062 GiB: 1,024 blocks, 16,384 tokens -> 146 requests" in out
    assert "disk tier 1.000 GiB: 16,368 blocks, 261,888 tokens -> 2,338 requests" in out
    assert "store tier 0.000 GiB: 1 blocks, 16 tokens -> 0 requests" in out


def test_plan_shows_the_bound_under_streaming_eviction(qwen3_checkpoint: Path,
                                                       capsys: pytest.CaptureFixture) -> None:
    """Sinks 4 and window 60 tokens are 1 + 4 blocks of 16 (4,096 bytes a token: 65,536 a
    block), however long the request: 20,100 tokens would take 1,257 blocks. The prompt and
    its first decode slot take 7 (a prompt pushed whole is bounded at its first step): what
    the request holds at most, as admission and the pool count it (kvferry/cache/budget.py),
    so 256 MiB (4,096 blocks) holds 585 such requests."""
    assert main(["plan", "--model", str(qwen3_checkpoint), "--dtype", "float32",
                 "--prompt-tokens", "100", "--output-tokens", "20000", "--pool-size",
                 "256MiB", "--kv-eviction", "streaming", "--kv-sink-tokens", "4",
                 "--kv-window-tokens", "60"]) == 0
    out = capsys.readouterr().out
    assert ("at most 5 blocks, 327,680 bytes, per sequence however long it runs; this request "
            "holds 7 of the 1257 blocks it would without eviction; the pool holds 819 sequences "
            "at the bound") in out
    assert "7 blocks per request, pool holds 4,096 blocks -> 585 requests fit" in out


def test_plan_shows_the_bound_under_h2o(qwen3_checkpoint: Path,
                                       capsys: pytest.CaptureFixture) -> None:
    """Heavy 40 and recent 60 tokens are 3 + 4 blocks of 16."""
    assert main(["plan", "--model", str(qwen3_checkpoint), "--dtype", "float32",
                 "--prompt-tokens", "100", "--output-tokens", "20000", "--kv-eviction", "h2o",
                 "--kv-heavy-tokens", "40", "--kv-recent-tokens", "60"]) == 0
    out = capsys.readouterr().out
    assert ("kv eviction h2o (heavy 40 and recent 60 tokens, in whole blocks of 16): at most "
            "7 blocks, 458,752 bytes, per sequence however long it runs") in out


def test_bad_dtype_is_named() -> None:
    with pytest.raises(ValueError, match="dtype"):
        KvShape(1, 1, 1, "float64")


# Other architectures' field names, read through transformers' AutoConfig.
GPT2_SMALL = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": 12,
              "n_head": 12, "n_embd": 768}
LLAMA3_8B_GQA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], **LLAMA3_8B}
# No model_type: read as written; older Falcon configs name their K/V heads `n_head_kv`.
FALCON_40B_RAW = {"num_hidden_layers": 60, "num_attention_heads": 128, "n_head_kv": 8,
                  "hidden_size": 8192}
FALCON_7B_MQA = {"model_type": "falcon", "num_hidden_layers": 32, "num_attention_heads": 71,
                 "hidden_size": 4544, "multi_query": True}


@pytest.mark.parametrize("config,expected", [
    # 2 x n_layer x n_head x (n_embd / n_head) x 2 bytes
    (GPT2_SMALL, 2 * 12 * 12 * (768 // 12) * 2),
    # 2 x 32 layers x 8 kv heads x (4096 / 32) x 2 bytes
    (LLAMA3_8B_GQA, 2 * 32 * 8 * 128 * 2),
    # multi-query: one K/V head
    (FALCON_7B_MQA, 2 * 32 * 1 * (4544 // 71) * 2),
    (FALCON_40B_RAW, 2 * 60 * 8 * 64 * 2),
])
@pytest.mark.parametrize("as_directory", [False, True])
def test_plan_reads_any_architectures_field_names(
        config: dict, expected: int, as_directory: bool, tmp_path: Path,
        capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    model = tmp_path if as_directory else path
    assert main(["plan", "--model", str(model), "--dtype", "bfloat16"]) == 0
    assert f"bytes per token: {expected:,}" in capsys.readouterr().out
    assert KvShape.from_config(model).bytes_per_token == expected


@pytest.mark.parametrize("block_size,batch,match", [
    (3, 1, "block_size"), (0, 1, "block_size"), (16, 0, "batch"),
])
def test_plan_refuses_bad_arguments(block_size: int, batch: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        plan(KvShape(1, 1, 1), 10, 0, batch, 1 << 20, block_size)


def test_a_config_without_attention_is_named(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"num_hidden_layers": 4, "hidden_size": 64}))
    with pytest.raises(ValueError, match="num_attention_heads"):
        KvShape.from_config(path)


def test_plan_reads_a_gguf_files_metadata(tmp_path: Path,
                                          capsys: pytest.CaptureFixture) -> None:
    gguf = pytest.importorskip("gguf")
    import numpy as np

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(4)
    writer.add_context_length(128)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(8)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tensor("token_embd.weight", np.zeros((16, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert main(["plan", "--model", str(path), "--dtype", "bfloat16"]) == 0
    # 2 x 4 layers x 2 kv heads x (64 / 8) x 2 bytes
    assert f"bytes per token: {2 * 4 * 2 * 8 * 2:,}" in capsys.readouterr().out


# What serve would store: the default model, its dtype on this machine, quantized
# pages, serve's pool size. SmolLM2-135M: 30 layers x 3 kv heads x 64.
@pytest.mark.parametrize("argv,per_token,dtype", [
    (["--device", "cpu"], 2 * 30 * 3 * 64 * 4, "float32"),  # the workers' float32 on CPU
    (["--device", "cuda"], 2 * 30 * 3 * 64 * 2, "bfloat16"),  # bfloat16 on CUDA
    (["--kv-cache-dtype", "int8"], 2 * 30 * 3 * (64 + 4), "int8"),  # a scale per token, head
    (["--device", "cuda", "--dtype", "float16"], 2 * 30 * 3 * 64 * 2, "float16"),
])
def test_plan_defaults_to_what_serve_stores(argv: list[str], per_token: int, dtype: str,
                                            capsys: pytest.CaptureFixture) -> None:
    assert main(["plan", *argv, "--pool-size", "256MiB"]) == 0
    out = capsys.readouterr().out
    assert "SmolLM2-135M-Instruct" in out and f"head dim, {dtype}\n" in out
    assert f"bytes per token: {per_token:,}" in out
    blocks = (256 << 20) // (16 * per_token)
    assert f"pool holds {blocks:,} blocks" in out


def test_plan_takes_a_fraction_of_memory_and_names_partial_dimensions(
        capsys: pytest.CaptureFixture) -> None:
    import os

    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert main(["plan", "--device", "cpu", "--layers", "1", "--kv-heads", "1",
                 "--head-dim", "4", "--pool-size", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "the given dimensions" in out
    assert f"pool holds {int(0.5 * ram) // (16 * 32):,} blocks" in out  # 32 B a token
    assert main(["plan", "--layers", "2"]) == 2
    assert "--layers, --kv-heads and --head-dim together" in capsys.readouterr().err
