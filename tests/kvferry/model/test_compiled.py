"""The compiled decode step (kvferry.model.compiled): the same tokens as the eager step and as
transformers, over batches that grow, shrink and outgrow the buckets, with one compile per
bucket, none after warm-up, and none on a second start (the packages are loaded)."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import stat
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvferry.cache.budget import blocks_for_tokens
from kvferry.cache.pool import KvPool
from kvferry.model.compiled import AUTO_MODES, CHOICE, PACKAGE, CompiledDecode, compile_decode
from kvferry.model.config import load_model_config
from kvferry.model.transformer import Transformer
from kvferry.settings import parse_batch_sizes
from kvferry_kernels import artifact_cache
from kvferry_kernels.dispatch import get_attention_backend
from tests.kvferry.model.builds import Built, build

BUCKETS = (1, 2)
STEPS = 10
# (prompt, first step it decodes in): batches of 1, 2, 3 (above every bucket: eager), then 2
# and 1 as the shorter ones finish; contexts cross block boundaries on the way.
PROMPTS = [(list(range(10, 27)), 0), ([5, 9, 200], 2), (list(range(40, 71)), 4)]


def _decode_all(model: Transformer, pool: KvPool) -> list[list[int]]:
    """Greedy tokens of every PROMPT, each joining the batch at its step and running STEPS."""
    tables = [pool.allocator.alloc(blocks_for_tokens(len(p) + STEPS + 1, 16))[::-1]
              for p, _ in PROMPTS]
    tokens: list[list[int]] = []
    for (prompt, _), table in zip(PROMPTS, tables):
        logits = model.prefill(torch.tensor(prompt), [len(prompt)],
                               pool.slots(table, 0, len(prompt)), pool)
        tokens.append([int(logits[0].argmax())])
    for step in range(max(start for _, start in PROMPTS) + STEPS):
        rows = [i for i, (_, start) in enumerate(PROMPTS) if start <= step < start + STEPS]
        positions = [len(PROMPTS[i][0]) + len(tokens[i]) - 1 for i in rows]
        width = max(len(tables[i]) for i in rows)
        block_tables = torch.tensor([tables[i] + [0] * (width - len(tables[i])) for i in rows],
                                    dtype=torch.int32)
        slots = torch.cat([pool.slots(tables[i], pos, pos + 1) for i, pos in zip(rows, positions)])
        logits = model.decode(torch.tensor([tokens[i][-1] for i in rows]),
                              torch.tensor(positions), slots, block_tables, pool)
        for row, i in enumerate(rows):
            tokens[i].append(int(logits[row].argmax()))
    for table in tables:
        pool.allocator.free(table)
    return tokens


def _compile(model: Transformer, cache: Path) -> CompiledDecode | None:
    return compile_decode(model, "default", BUCKETS, cache)


# The tests that compile (a minute or more each on 2 cores) run in the full tier only. Qwen3's
# first build is shared by the module's tests (each compile is ~20 s of the machine).
@pytest.fixture(scope="module")
def qwen3_built(request: pytest.FixtureRequest) -> Built:
    return build(request, "qwen3", _compile)


@pytest.fixture(scope="module")
def llama_built(request: pytest.FixtureRequest) -> Built:
    return build(request, "llama", _compile)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_compiled_decode_matches_eager_and_transformers(arch: str,
                                                        request: pytest.FixtureRequest) -> None:
    built: Built = request.getfixturevalue(f"{arch}_built")
    checkpoint, compiled, cache = built
    config = load_model_config(checkpoint)
    model = compiled.model
    pool = KvPool(config.num_layers, config.num_kv_heads, config.head_dim, 16, 64, torch.float32)
    eager = _decode_all(Transformer(config, get_attention_backend("torch")), pool)

    assert compiled.num_compiles == len(BUCKETS)  # warm-up: one graph per bucket
    assert model.compiled is compiled
    got = _decode_all(model, pool)
    assert got == eager
    assert compiled.num_compiles == len(BUCKETS)  # batches 1-3, contexts 3-41: no recompile
    assert compiled.num_cache_hits == 0
    packages = sorted((cache / "aoti").glob(f"decode-*/{PACKAGE}"))
    assert len(packages) == len(BUCKETS)  # one package per bucket, nothing half-written left
    assert len(list((cache / "aoti").iterdir())) == len(BUCKETS)

    # A second start with the same cache loads every bucket's package instead of compiling.
    restarted = compile_decode(model, "default", BUCKETS, cache)
    assert restarted is not None and restarted.num_cache_hits == len(BUCKETS)
    assert _decode_all(model, pool) == eager
    assert restarted.num_compiles == len(BUCKETS)

    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    for (prompt, _), tokens in zip(PROMPTS, got):
        expected = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=STEPS + 1,
                               eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert tokens == expected


@pytest.mark.slow
def test_loading_leaves_no_extracted_package_on_disk(
        qwen3_built: Built, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # torch extracts a package (weights included) under $TMPDIR on load and removes it only
    # when the loader is destroyed: never in a worker killed or ended with os._exit.
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))
    monkeypatch.setattr("tempfile.tempdir", str(temp))
    model = Transformer(load_model_config(qwen3_built.checkpoint), get_attention_backend("torch"))
    loaded = compile_decode(model, "default", BUCKETS, qwen3_built.cache)
    assert loaded is not None and loaded.num_cache_hits == len(BUCKETS)
    assert list(temp.iterdir()) == []  # while every loaded package is in use
    assert os.environ["TMPDIR"] == str(temp)
    pool = KvPool(model.config.num_layers, model.config.num_kv_heads, model.config.head_dim,
                  16, 64, torch.float32)
    assert _decode_all(model, pool) == _decode_all(
        Transformer(model.config, get_attention_backend("torch")), pool)


def test_compile_off_is_eager(qwen3_checkpoint: Path) -> None:
    model = Transformer(load_model_config(qwen3_checkpoint), get_attention_backend("torch"))
    assert compile_decode(model, "off") is None and model.compiled is None


@pytest.mark.parametrize("text, error", [
    ("1,x", "comma-separated integers"), ("0,4", "in [1, 4096]"), ("", "in [1, 4096]"),
    ("8192", "in [1, 4096]")])
def test_bad_batch_sizes_are_refused_naming_the_flag(text: str, error: str) -> None:
    with pytest.raises(ValueError, match=f"compile_batch_sizes: .*{re.escape(error)}"):
        parse_batch_sizes(text)


def test_batch_sizes_are_sorted_and_distinct() -> None:
    assert parse_batch_sizes("8, 1,4,4") == (1, 4, 8)


@pytest.mark.slow
def test_auto_times_both_modes_keeps_the_faster_and_a_restart_obeys_its_record(
        qwen3_built: Built, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = load_model_config(qwen3_built.checkpoint)
    model = Transformer(config, get_attention_backend("torch"))
    pool = KvPool(config.num_layers, config.num_kv_heads, config.head_dim, 16, 64, torch.float32)
    eager = _decode_all(model, pool)
    cache = tmp_path / "cache"
    shutil.copytree(qwen3_built.cache, cache)  # "default" packages, no choice record

    first = compile_decode(model, "auto", (1,), cache)  # timed for real
    # Both modes' packages: "default" loaded from the cache, "max-autotune" built.
    assert first is not None and first.num_builds == 1
    assert len(list((cache / "aoti").glob(f"decode-*/{PACKAGE}"))) == len(BUCKETS) + 1
    times = first.step_ms[1]
    assert set(times) == set(AUTO_MODES) and all(ms > 0 for ms in times.values())
    assert first.modes[1] == min(times, key=times.get)
    record = next((cache / "aoti").glob("choice-*"))  # a verified cache entry
    assert json.loads((record / CHOICE).read_text()) == {"mode": first.modes[1],
                                                         "ms_per_step": times}
    assert _decode_all(model, pool) == eager

    # A restart loads the recorded mode's package alone, timing nothing.
    for chosen in AUTO_MODES:
        _rewrite(record, json.dumps({"mode": chosen}))
        restarted = compile_decode(model, "auto", (1,), cache)
        assert restarted is not None and restarted.modes == {1: chosen}
        assert (restarted.num_builds, restarted.num_cache_hits, restarted.step_ms) == (0, 1, {})
        assert _decode_all(model, pool) == eager

    # No valid record: both timed again (loaded, not built), the faster chosen.
    for faster in AUTO_MODES:
        _rewrite(record, "{not json")
        fake = {mode: 1.0 if mode == faster else 2.0 for mode in AUTO_MODES}
        monkeypatch.setattr("kvferry.model.compiled.median_ms", lambda steps, fake=fake: dict(fake))
        rechosen = compile_decode(model, "auto", (1,), cache)
        assert rechosen is not None and rechosen.modes == {1: faster}
        assert (rechosen.num_builds, rechosen.num_cache_hits) == (0, 1)
        assert json.loads((record / CHOICE).read_text())["mode"] == faster


def _rewrite(record: Path, text: str) -> None:
    """Replace a choice record's text, its manifest sealed again (as if written so)."""
    (record / CHOICE).write_text(text)
    artifact_cache.seal(record)


def _flip_a_middle_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))  # the same size: only the hash can tell


# What a crash, a planted stub or bit rot leaves in a cache entry's file.
CORRUPTIONS = {
    "truncated": lambda path: os.truncate(path, path.stat().st_size // 2),
    "stub": lambda path: path.write_bytes(b"not a package\n"),
    "hash mismatch": _flip_a_middle_byte,
}


class Cached(NamedTuple):
    model: Transformer
    cache: Path  # holds bucket 1's verified "default" package
    package: Path  # that package's file


@pytest.fixture(scope="module")
def cached(qwen3_built: Built, tmp_path_factory: pytest.TempPathFactory) -> Cached:
    """Bucket 1's package of the module's first build, alone in a cache of its own."""
    model = Transformer(load_model_config(qwen3_built.checkpoint),
                        get_attention_backend("torch"))
    entry = f"decode-{qwen3_built.compiled.package_key(1, 'default')}"
    cache = tmp_path_factory.mktemp("compile-cache")
    shutil.copytree(qwen3_built.cache / "aoti" / entry, cache / "aoti" / entry)
    return Cached(model, cache, cache / "aoti" / entry / PACKAGE)


@pytest.fixture
def copying_build(cached: Cached, monkeypatch: pytest.MonkeyPatch) -> None:
    """Builds copy the fixture's package (compiling it again would take a minute): what is
    under test is the cache around the build."""
    monkeypatch.setattr(CompiledDecode, "_build", copying(cached.package))


def copying(package: Path) -> Callable[[CompiledDecode, int, str, Path], None]:
    """A `CompiledDecode._build` that copies `package` instead of compiling it, counted as a
    build: for tests of what surrounds the build (the cache, its keys)."""
    def build(self: CompiledDecode, size: int, mode: str, scratch: Path) -> None:
        shutil.copy(package, scratch / PACKAGE)
        self.num_builds += 1

    return build


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
@pytest.mark.slow
@pytest.mark.usefixtures("copying_build")
def test_a_bad_package_is_never_loaded_but_rebuilt_with_one_warning(
        cached: Cached, tmp_path: Path, corruption: str,
        caplog: pytest.LogCaptureFixture) -> None:
    shutil.copytree(cached.cache / "aoti", tmp_path / "aoti")
    entry = tmp_path / "aoti" / cached.package.parent.name
    CORRUPTIONS[corruption](entry / PACKAGE)
    with caplog.at_level(logging.WARNING):
        compiled = compile_decode(cached.model, "default", (1,), tmp_path)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and str(entry) in warnings[0], warnings
    assert compiled is not None and (compiled.num_builds, compiled.num_cache_hits) == (1, 0)
    assert artifact_cache.verify(entry) is None  # a fresh, verified package, then loaded
    assert (entry / PACKAGE).read_bytes() == cached.package.read_bytes()


@pytest.mark.slow
@pytest.mark.usefixtures("copying_build")
def test_a_bad_choice_record_is_timed_again_with_one_warning(
        cached: Cached, tmp_path: Path, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("kvferry.model.compiled.median_ms",
                        lambda steps: {"default": 1.0, "max-autotune": 2.0})
    assert compile_decode(cached.model, "auto", (1,), tmp_path) is not None
    record = next((tmp_path / "aoti").glob("choice-*"))
    os.truncate(record / CHOICE, 3)
    with caplog.at_level(logging.WARNING):
        compiled = compile_decode(cached.model, "auto", (1,), tmp_path)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and str(record) in warnings[0], warnings
    assert compiled is not None and compiled.step_ms == {1: {"default": 1.0,
                                                             "max-autotune": 2.0}}
    assert artifact_cache.verify(record) is None
    assert json.loads((record / CHOICE).read_text())["mode"] == "default"


@pytest.mark.slow
@pytest.mark.usefixtures("copying_build")
def test_a_cache_others_may_write_is_refused_with_one_line(
        cached: Cached, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    shutil.copytree(cached.cache / "aoti", tmp_path / "aoti")  # valid, but anyone could swap it
    tmp_path.chmod(tmp_path.stat().st_mode | stat.S_IWOTH)
    with caplog.at_level(logging.WARNING):
        compiled = compile_decode(cached.model, "default", (1,), tmp_path)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and f"refusing {tmp_path} " in warnings[0], warnings
    assert compiled is not None and (compiled.num_builds, compiled.num_cache_hits) == (1, 0)
    assert compiled.cache_dir is not None and compiled.cache_dir != tmp_path  # built privately
    assert stat.S_IMODE(compiled.cache_dir.stat().st_mode) == 0o700
    entry = compiled.cache_dir / "aoti" / cached.package.parent.name
    assert artifact_cache.verify(entry) is None
