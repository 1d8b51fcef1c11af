"""The "dynamic" compiled forward (kvferry.model.compiled.CompiledForward): ONE package with a
dynamic row count serves decode steps (the same tokens as eager and as transformers over
batches that grow and shrink) and prefill (several prompts packed in one forward, one of them
a chunk over cached context, logits of the sampled rows only: the same logits, K/V and
attention mass as eager, `on_layer_done` once per layer in order); one compile, none after
warm-up, none on a second start (the package is loaded)."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvferry.cache.budget import blocks_for_tokens
from kvferry.cache.pool import KvPool
from kvferry.model.compiled import (
    DEFAULT_MAX_ROWS,
    DYNAMIC,
    EXACT_ROWS,
    PACKAGE,
    CompiledDecode,
    CompiledForward,
    attend_nothing,
    compile_decode,
    compile_model,
    row_grid,
)
from kvferry.model.config import load_model_config
from kvferry.model.transformer import Transformer
from kvferry_kernels.dispatch import get_attention_backend
from tests.kvferry.model.builds import Built, build
from tests.kvferry.model.test_compiled import PROMPTS, STEPS, _decode_all

MAX_ROWS = 40  # above _decode_all's prompts (31 tokens) and PACKED (35): LONG runs eagerly
# (prompt, tokens of it already in the pool before the packed forward): two fresh prompts
# and a chunk over 20 cached tokens (chunked prefill); the second adds up attention mass.
PACKED = [(list(range(10, 27)), 0), ([5, 9, 200, 7, 3], 0), (list(range(40, 73)), 20)]
LONG = list(range(3, 3 + MAX_ROWS + 5))


def _pool(model: Transformer) -> KvPool:
    cfg = model.config
    return KvPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 16, 64, torch.float32)


def _compile(model: Transformer, cache: Path) -> CompiledForward:
    compiled = compile_model(model, DYNAMIC, cache_dir=cache, max_rows=MAX_ROWS)
    assert isinstance(compiled, CompiledForward)
    return compiled


# Each build (~20 s of the machine) is shared by the module's tests, full tier only.
@pytest.fixture(scope="module")
def qwen3_dynamic(request: pytest.FixtureRequest) -> Built:
    return build(request, "qwen3", _compile)


@pytest.fixture(scope="module")
def llama_dynamic(request: pytest.FixtureRequest) -> Built:
    return build(request, "llama", _compile)


class Prefilled(NamedTuple):
    logits: torch.Tensor  # [chunks, vocab]
    pool: KvPool
    mass: torch.Tensor
    layers_done: list[int]


def _prefill_packed(model: Transformer, layer_check: bool = False) -> Prefilled:
    """PACKED's context prefilled (one prompt each), then every chunk in one forward. With
    `layer_check`, on_layer_done asserts that its layer's K/V is in the pool and the next
    layer's is not yet."""
    pool = _pool(model)
    tables = [pool.allocator.alloc(blocks_for_tokens(len(p), 16))[::-1] for p, _ in PACKED]
    for (prompt, context), table in zip(PACKED, tables):
        if context:
            model.prefill(torch.tensor(prompt[:context]), [context],
                          pool.slots(table, 0, context), pool)
    chunks = [prompt[context:] for prompt, context in PACKED]
    slots = torch.cat([pool.slots(t, c, len(p)) for (p, c), t in zip(PACKED, tables)])
    mass = torch.zeros(len(PACKED[1][0]))
    done: list[int] = []

    def on_layer_done(layer: int) -> None:
        if layer_check:
            assert pool.k_cache(layer)[:, :, 0].flatten(0, 1)[slots].abs().sum() > 0
            if layer + 1 < model.config.num_layers:
                assert not pool.k_cache(layer + 1).flatten(0, 1)[slots].any()
        done.append(layer)

    logits = model.prefill(torch.tensor(sum(chunks, [])), [len(c) for c in chunks], slots, pool,
                           context_lens=[c for _, c in PACKED], block_tables=tables,
                           on_layer_done=on_layer_done, mass=[None, mass, None])
    return Prefilled(logits, pool, mass, done)


def _eager(checkpoint: Path) -> Transformer:
    return Transformer(load_model_config(checkpoint), get_attention_backend("torch"))


def _no_eager_forward(model: Transformer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make `model`'s eager forward fail: every forward must run through its package."""
    def eager(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("an eager forward where the package covers the rows")

    monkeypatch.setattr(model, "forward_tokens", eager)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_decode_through_the_dynamic_package_matches_eager_and_transformers(
        arch: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    checkpoint, compiled, _ = request.getfixturevalue(f"{arch}_dynamic")
    model = compiled.model
    eager = _decode_all(_eager(checkpoint), _pool(model))
    with monkeypatch.context() as patched:
        _no_eager_forward(model, patched)
        got = _decode_all(model, _pool(model))  # prefills and batches 1-3 through the package
    assert got == eager
    assert (compiled.num_compiles, compiled.num_builds, compiled.num_cache_hits) == (1, 1, 0)
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    for (prompt, _), tokens in zip(PROMPTS, got):
        expected = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=STEPS + 1,
                               eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert tokens == expected


@pytest.mark.slow
def test_packed_chunked_prefill_matches_eager_logits_kv_and_mass(
        qwen3_dynamic: Built, monkeypatch: pytest.MonkeyPatch) -> None:
    model = qwen3_dynamic.compiled.model
    want = _prefill_packed(_eager(qwen3_dynamic.checkpoint))
    with monkeypatch.context() as patched:
        _no_eager_forward(model, patched)
        got = _prefill_packed(model, layer_check=True)
    assert got.logits.shape == (len(PACKED), model.config.vocab_size)  # sampled rows only
    assert torch.equal(got.logits.argmax(-1), want.logits.argmax(-1))
    torch.testing.assert_close(got.logits, want.logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got.pool.cache, want.pool.cache, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.mass, want.mass, atol=1e-5, rtol=1e-5)
    assert got.mass.sum() > 0
    layers = list(range(model.config.num_layers))
    assert got.layers_done == want.layers_done == layers  # once per layer, in order
    assert qwen3_dynamic.compiled.num_compiles == 1


@pytest.mark.slow
def test_rows_above_max_rows_run_eagerly(qwen3_dynamic: Built) -> None:
    compiled = qwen3_dynamic.compiled
    tokens = torch.tensor(LONG)
    assert compiled(tokens, torch.arange(len(LONG)), attend_nothing) is None
    model, eager = compiled.model, _eager(qwen3_dynamic.checkpoint)
    results = []
    for m in (model, eager):
        pool = _pool(m)
        table = pool.allocator.alloc(blocks_for_tokens(len(LONG), 16))
        results.append(m.prefill(tokens, [len(LONG)], pool.slots(table, 0, len(LONG)), pool))
    assert torch.equal(results[0], results[1])  # both eager: bit for bit
    assert compiled.num_compiles == 1


@pytest.mark.slow
def test_a_second_start_loads_the_package_and_pads_rows_as_asked(qwen3_dynamic: Built) -> None:
    checkpoint, first, cache = qwen3_dynamic
    entries = list((cache / "aoti").iterdir())
    assert [e.name for e in entries] == [f"decode-{first.package_key(MAX_ROWS, DYNAMIC)}"]
    assert (entries[0] / PACKAGE).is_file()
    assert first.package_key(MAX_ROWS + 1, DYNAMIC) != first.package_key(MAX_ROWS, DYNAMIC)

    model = _eager(checkpoint)
    eager = _decode_all(model, _pool(model))
    # pad_rows_to is a policy at run time: the same package serves it.
    restarted = compile_decode(model, DYNAMIC, cache_dir=cache, max_rows=MAX_ROWS,
                               pad_rows_to=8)
    assert isinstance(restarted, CompiledForward)
    assert (restarted.num_compiles, restarted.num_builds, restarted.num_cache_hits) == (1, 0, 1)
    assert _decode_all(model, _pool(model)) == eager  # rows padded to 8, 24, 32, 40
    want, got = _prefill_packed(_eager(checkpoint)), _prefill_packed(model)
    assert torch.equal(got.logits.argmax(-1), want.logits.argmax(-1))
    torch.testing.assert_close(got.pool.cache, want.pool.cache, atol=1e-5, rtol=1e-5)
    assert restarted.num_compiles == 1 and len(list((cache / "aoti").iterdir())) == 1


def test_rows_are_padded_to_a_multiple_within_max_rows(qwen3_checkpoint: Path) -> None:
    model = _eager(qwen3_checkpoint)
    unpadded = CompiledForward(model, 40)
    assert [unpadded.padded_rows(n) for n in (0, 1, 7, 40, 41)] == [None, 1, 7, 40, None]
    padded = CompiledForward(model, 40, pad_rows_to=16)
    assert [padded.padded_rows(n) for n in (1, 16, 17, 33, 40, 41)] == [16, 16, 32, 40, 40, None]


def test_row_counts_above_16_run_on_a_grid_of_at_most_50_sizes_25_percent_apart() -> None:
    sizes = [row_grid(n) for n in range(1, DEFAULT_MAX_ROWS + 1)]
    assert sizes[:EXACT_ROWS] == list(range(1, EXACT_ROWS + 1))  # small batches: exact
    assert all(n <= size <= 1.25 * n for n, size in enumerate(sizes, start=1))
    assert len(set(sizes)) <= 50
    assert [row_grid(n) for n in (17, 20, 21, 33, 64, 65, 512, 513)] == [
        20, 20, 24, 40, 64, 80, 512, 640]
    assert row_grid(DEFAULT_MAX_ROWS) == DEFAULT_MAX_ROWS  # the largest row count on the grid


@pytest.mark.parametrize("field, kwargs", [("max_rows", {"max_rows": 1}),
                                           ("pad_rows_to", {"pad_rows_to": 0})])
def test_bad_row_settings_are_refused_naming_them(qwen3_checkpoint: Path, field: str,
                                                  kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError, match=f"compile {field}: expected at least"):
        CompiledForward(_eager(qwen3_checkpoint), **kwargs)


def test_buckets_refuse_dynamic_and_leave_prefill_eager(qwen3_checkpoint: Path) -> None:
    model = _eager(qwen3_checkpoint)
    with pytest.raises(ValueError, match="compile: expected one of"):
        CompiledDecode(model, DYNAMIC)
    buckets = CompiledDecode(model, "default", (1, 2))  # not warmed up: nothing built
    tokens = torch.zeros(2, dtype=torch.int64)
    assert buckets(tokens, tokens, attend_nothing, logit_rows=torch.tensor([1])) is None
