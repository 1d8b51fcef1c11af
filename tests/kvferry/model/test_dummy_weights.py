"""`--load-format dummy` and `make-model --shape`: random weights of a checkpoint's shapes made
on the device, and published models' configs without weights."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvferry.cache.layout import KvShape
from kvferry.cache.pool import KvPool
from kvferry.model.config import load_model_config
from kvferry.model.shapes import PUBLISHED_SHAPES, make_shape
from kvferry.model.transformer import Transformer
from kvferry.model.weights import dummy_weights, load_weights
from kvferry_kernels.dispatch import get_attention_backend


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_dummy_weights_have_the_checkpoints_names_shapes_and_dtype(
        arch: str, request: pytest.FixtureRequest) -> None:
    checkpoint = request.getfixturevalue(f"{arch}_checkpoint")
    config = load_model_config(checkpoint)
    real = load_weights(checkpoint, config, torch.device("cpu"), torch.bfloat16)
    dummy = dummy_weights(config, torch.device("cpu"), torch.bfloat16)
    assert {n: (t.shape, t.dtype) for n, t in dummy.items()} == {
        n: (t.shape, t.dtype) for n, t in real.items()}
    again = dummy_weights(config, torch.device("cpu"), torch.bfloat16)
    assert all(torch.equal(dummy[n], again[n]) for n in dummy)  # every worker makes the same
    other = dummy_weights(config, torch.device("cpu"), torch.bfloat16, seed=1)
    assert not torch.equal(dummy["lm_head.weight"], other["lm_head.weight"])


def _config_only(checkpoint: Path, out: Path) -> Path:
    out.mkdir()
    for file in checkpoint.iterdir():
        if file.suffix != ".safetensors":
            shutil.copy(file, out / file.name)
    return out


def test_a_config_without_weights_serves_dummy_and_decodes_finite_tokens(
        qwen3_checkpoint: Path, tmp_path: Path) -> None:
    bare = _config_only(qwen3_checkpoint, tmp_path / "bare")
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        Transformer(load_model_config(bare), get_attention_backend("torch"))
    config = load_model_config(bare, load_format="dummy")
    assert config.fingerprint != load_model_config(bare).fingerprint  # no cache shared
    assert config.fingerprint != load_model_config(qwen3_checkpoint).fingerprint
    model = Transformer(config, get_attention_backend("torch"))
    pool = KvPool(config.num_layers, config.num_kv_heads, config.head_dim, 16, 8, torch.float32)
    table = pool.allocator.alloc(2)
    prompt = torch.tensor([5, 9, 200, 31, 7])
    logits = model.prefill(prompt, [5], pool.slots(table, 0, 5), pool)
    token = int(logits[0].argmax())
    step = model.decode(torch.tensor([token]), torch.tensor([5]), pool.slots(table, 5, 6),
                        torch.tensor([table], dtype=torch.int32), pool)
    assert torch.isfinite(logits).all() and torch.isfinite(step).all()
    assert step.shape == (1, config.vocab_size)


def test_load_format_is_checked_by_name() -> None:
    with pytest.raises(ValueError, match="load_format: expected one of auto, dummy"):
        load_model_config(".", load_format="random")


@pytest.mark.parametrize("shape", sorted(PUBLISHED_SHAPES))
def test_published_shapes_load_as_their_models(shape: str, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    config = load_model_config(make_shape(tmp_path, shape), load_format="dummy")
    fields = PUBLISHED_SHAPES[shape]
    assert (config.architecture, config.num_layers, config.vocab_size) == (
        fields["architectures"][0], fields["num_hidden_layers"], fields["vocab_size"])
    # bytes per token as ../shared/REFERENCES.md gives them (Llama-3-8B: 131,072 B)
    per_token = KvShape(config.num_layers, config.num_kv_heads, config.head_dim,
                        "bfloat16").bytes_per_token
    assert per_token == {"llama-3.1-8b": 131072, "qwen3-8b": 147456}[shape]
    tokenizer = AutoTokenizer.from_pretrained(config.path)
    last = config.vocab_size - 1
    assert tokenizer.decode([0, last]) == f"t0 t{last}"
    assert config.eos_token_ids == (fields["eos_token_id"],)


def test_make_model_shape_on_the_command_line(tmp_path: Path) -> None:
    kvferry = str(Path(sys.executable).parent / "kvferry")
    done = subprocess.run([kvferry, "make-model", "--shape", "qwen3-8b", "--out",
                           str(tmp_path / "q")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "--load-format dummy" in done.stdout
    assert (tmp_path / "q" / "config.json").exists()
    assert not list((tmp_path / "q").glob("*.safetensors"))


def test_serve_passes_the_load_format_to_the_router_and_every_worker() -> None:
    from deploy import cli
    from deploy.args import build_parser, router_settings, worker_settings

    deployment = cli._deployment(build_parser().parse_args(
        ["serve", "--model", "/m", "--load-format", "dummy"]))
    router = deployment._router_args("127.0.0.1", {})
    assert router[router.index("--load-format") + 1] == "dummy"
    for role in ("prefill", "decode"):
        argv = deployment._worker_args(role)
        assert argv[argv.index("--load-format") + 1] == "dummy"
        worker = build_parser().parse_args(argv[argv.index(f"{role}-worker"):])
        assert worker_settings(worker).load_format == "dummy"
    routed = build_parser().parse_args(["router", "--model", "/m", "--load-format", "dummy",
                                       "--prefill", "a:1", "--decode", "b:2"])
    assert router_settings(routed).load_format == "dummy"


def test_bench_launches_with_the_load_format_on_every_process() -> None:
    from deploy.args import build_parser
    from deploy.loadgen.cli import load_format_argv

    args = build_parser().parse_args(["bench", "--address", "launch:disagg", "--model", "/m",
                                      "--load-format", "dummy"])
    assert load_format_argv(args) == ["--load-format", "dummy"]
    assert load_format_argv(build_parser().parse_args(["bench"])) == []
