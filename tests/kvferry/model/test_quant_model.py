"""The model over quantized K/V pages against an independent oracle: transformers
`generate` whose cache stores every K/V vector fake-quantized by `_fake_quantize` below, the
format written out from its definition (one scale per token and K/V head, int8 or fp8 e4m3)
without `kvferry_kernels.kv_quant` (the oracle must not share kvferry's quantizer).
kvferry quantizes where K/V is written (prefill and the decode append) and attends over what
the pages hold, the prompt's own tokens included, so greedy tokens must be identical, whatever
the prefill's chunking, and every step's logits must agree to LOGITS_ATOL (they are bit for bit
equal on CPU today). Greedy tokens alone miss small quantizer errors (an int8 scale of amax /
126 leaves this model's tokens unchanged); that error moves the logits by ~0.1."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.cache_utils import DynamicLayer

from kvferry.cache.budget import blocks_for_tokens
from kvferry.cache.pool import KvPool
from kvferry.model.config import load_model_config
from kvferry.model.transformer import Transformer
from kvferry_kernels.dispatch import get_attention_backend

BLOCK = 16
PROMPT_LENGTHS = [1, 17, 40, 100]
NEW_TOKENS = 24
# Room for kernels that differ in summation order (a K/V code may round the other way); the
# quantization itself moves these logits by 0.07-0.4 (int8 / fp8 against full precision).
LOGITS_ATOL = 1e-2


def _e4m3(v: torch.Tensor) -> torch.Tensor:
    """float32 in [-448, 448] -> the nearest fp8 e4m3 value (ties to even), as float32: 3
    mantissa bits, so the step is 2^(e - 3) in the binade [2^e, 2^(e+1)), and 2^-9 below
    2^-6 (subnormals)."""
    mag = v.double().abs()
    _, exp = torch.frexp(mag)  # mag = m * 2^exp, m in [0.5, 1)
    step = torch.ldexp(torch.ones_like(mag), (exp - 1).clamp(min=-6) - 3)
    return (torch.round(mag / step) * step).copysign(v.double()).float()  # round: ties to even


def _fake_quantize(x: torch.Tensor, kv_dtype: str) -> torch.Tensor:
    """x [..., D] as a quantized page reads it back: scale = amax / qmax per vector in
    float32 (1 if all zero), codes = x / scale rounded to int8 (ties to even, clamped to
    +-127) or to e4m3 (clamped to +-448), times the scale. kv_quant also keeps the scale
    inside float32's normal range, which this model's K/V never leave."""
    qmax = 127.0 if kv_dtype == "int8" else 448.0
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)  # [..., 1]
    scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    scaled = (xf / scale).clamp(-qmax, qmax)
    codes = scaled.round() if kv_dtype == "int8" else _e4m3(scaled)
    return (codes * scale).to(x.dtype)


def _prompt(n: int) -> list[int]:
    return torch.randint(1, 500, (n,), generator=torch.Generator().manual_seed(n)).tolist()


@pytest.fixture(scope="module")
def hf(qwen3_checkpoint: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(qwen3_checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def model(qwen3_checkpoint: Path) -> Transformer:
    return Transformer(load_model_config(qwen3_checkpoint), get_attention_backend("torch"),
                       torch.float32, torch.device("cpu"))


@pytest.fixture
def quantizing_cache(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """transformers' cache layers store K/V fake-quantized as the dtype put in the list
    (full precision while it is empty)."""
    kv_dtype: list[str] = []
    update = DynamicLayer.update

    def quantized_update(self, key_states, value_states, *args, **kwargs):  # [B, H, T, D]
        if kv_dtype:  # else full precision, as unpatched
            key_states = _fake_quantize(key_states, kv_dtype[0])
            value_states = _fake_quantize(value_states, kv_dtype[0])
        return update(self, key_states, value_states, *args, **kwargs)

    monkeypatch.setattr(DynamicLayer, "update", quantized_update)
    yield kv_dtype


class Greedy(NamedTuple):
    tokens: list[int]
    logits: torch.Tensor  # [NEW_TOKENS, V], the logits each token was picked from


def _oracle(hf: torch.nn.Module, prompt: list[int]) -> Greedy:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW_TOKENS,
                          min_new_tokens=NEW_TOKENS, output_logits=True,
                          return_dict_in_generate=True)
    return Greedy(out.sequences[0, len(prompt):].tolist(), torch.stack(out.logits)[:, 0])


def _kvferry(model: Transformer, prompt: list[int], kv_dtype: str, chunk: int) -> Greedy:
    """Prefill in chunks of `chunk` tokens over a pool of `kv_dtype`, then greedy decode."""
    total = len(prompt) + NEW_TOKENS
    pool = KvPool(model.config.num_layers, model.config.num_kv_heads, model.config.head_dim,
                  BLOCK, blocks_for_tokens(total, BLOCK) + 2, torch.float32,
                  kv_cache_dtype=kv_dtype)
    table = list(range(pool.num_blocks))[::-1][:blocks_for_tokens(total, BLOCK)]
    for start in range(0, len(prompt), chunk):
        end = min(start + chunk, len(prompt))
        logits = model.prefill(torch.tensor(prompt[start:end]), [end - start],
                               pool.slots(table, start, end), pool, context_lens=[start],
                               block_tables=[table])
    steps = [logits[0]]
    tokens = [int(logits[0].argmax())]
    block_table = torch.tensor([table], dtype=torch.int32)
    for _ in range(NEW_TOKENS - 1):
        position = len(prompt) + len(tokens) - 1
        logits = model.decode(torch.tensor([tokens[-1]]), torch.tensor([position]),
                              pool.slots(table, position, position + 1), block_table, pool)
        steps.append(logits[0])
        tokens.append(int(logits[0].argmax()))
    return Greedy(tokens, torch.stack(steps))


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
def test_greedy_over_quantized_pages_matches_a_quantizing_transformers_cache(
        hf: torch.nn.Module, model: Transformer, quantizing_cache: list[str],
        kv_dtype: str) -> None:
    quantizing_cache.append(kv_dtype)
    for n in PROMPT_LENGTHS:
        prompt = _prompt(n)
        expected = _oracle(hf, prompt)
        # Chunked prefill reads the earlier chunks back from the pages.
        for chunk in [len(prompt), BLOCK + 3] if n > BLOCK else [len(prompt)]:
            got = _kvferry(model, prompt, kv_dtype, chunk)
            assert got.tokens == expected.tokens, (n, chunk)
            torch.testing.assert_close(got.logits, expected.logits, rtol=0, atol=LOGITS_ATOL,
                                       msg=lambda m, n=n, chunk=chunk: f"{n=} {chunk=}: {m}")


def test_the_oracle_sees_the_quantization(hf: torch.nn.Module,
                                          quantizing_cache: list[str]) -> None:
    """fp8's error is large enough to change this tiny model's greedy tokens somewhere: the
    patched cache is in effect (else every comparison above would be against fp32)."""
    prompts = [_prompt(n) for n in PROMPT_LENGTHS]
    full = [_oracle(hf, p).tokens for p in prompts]
    quantizing_cache.append("fp8_e4m3")
    assert [_oracle(hf, p).tokens for p in prompts] != full
