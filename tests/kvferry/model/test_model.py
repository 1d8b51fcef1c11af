"""In-process model checks against transformers: logits, and batched paged decoding."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvferry.cache.budget import blocks_for_tokens
from kvferry.cache.pool import KvPool
from kvferry.model.config import load_model_config
from kvferry.model.transformer import Transformer
from kvferry_kernels.dispatch import get_attention_backend
from tests.kvferry.model.greedy_split import decode_part


def _setup(checkpoint: Path) -> tuple[Transformer, torch.nn.Module, KvPool]:
    config = load_model_config(checkpoint)
    model = Transformer(config, get_attention_backend("torch"))
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    pool = KvPool(config.num_layers, config.num_kv_heads, config.head_dim, 16, 64, torch.float32)
    return model, hf, pool


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_prefill_logits_match_transformers(arch: str, request: pytest.FixtureRequest) -> None:
    model, hf, pool = _setup(request.getfixturevalue(f"{arch}_checkpoint"))
    prompts = [[5, 9, 200, 31, 7], list(range(40, 77))]
    blocks = pool.allocator.alloc(4)
    slots = torch.cat([pool.slots(blocks[:1], 0, 5), pool.slots(blocks[1:], 0, 37)])
    logits = model.prefill(torch.tensor(prompts[0] + prompts[1]), [5, 37], slots, pool)
    for row, prompt in enumerate(prompts):
        with torch.no_grad():
            expected = hf(torch.tensor([prompt])).logits[0, -1]
        torch.testing.assert_close(logits[row], expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_batched_paged_decode_matches_transformers(arch: str,
                                                   request: pytest.FixtureRequest) -> None:
    model, hf, pool = _setup(request.getfixturevalue(f"{arch}_checkpoint"))
    gen = torch.Generator().manual_seed(11)
    prompts = [[3], list(range(10, 27)), torch.randint(0, 300, (40,), generator=gen).tolist()]
    steps = 12
    tables, tokens = [], []
    # Interleave allocations so block tables are non-contiguous.
    for prompt in prompts:
        tables.append(pool.allocator.alloc(blocks_for_tokens(len(prompt) + steps, 16))[::-1])
    for prompt, table in zip(prompts, tables):
        logits = model.prefill(torch.tensor(prompt), [len(prompt)],
                               pool.slots(table, 0, len(prompt)), pool)
        tokens.append([int(logits[0].argmax())])
    decode_part(model, pool, tables, tokens, prompts, steps)
    for prompt, got in zip(prompts, tokens):
        expected = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=steps,
                               eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert got == expected


def test_corrupted_cache_changes_tokens(qwen3_checkpoint: Path) -> None:
    """The seeded model really attends to its cache: wrong K/V gives different tokens, so
    the token-exact end-to-end tests can catch transfer bugs."""
    model, _, pool = _setup(qwen3_checkpoint)
    prompt = list(range(30, 70))
    table = pool.allocator.alloc(blocks_for_tokens(len(prompt) + 8, 16))

    def run(corrupt: bool) -> list[int]:
        logits = model.prefill(torch.tensor(prompt), [len(prompt)],
                               pool.slots(table, 0, len(prompt)), pool)
        if corrupt:
            pool.cache[:, :, table[0]] = torch.randn_like(pool.cache[:, :, table[0]])
        out = [int(logits[0].argmax())]
        bt = torch.tensor([table], dtype=torch.int32)
        for _ in range(8):
            pos = len(prompt) + len(out) - 1
            logits = model.decode(torch.tensor([out[-1]]), torch.tensor([pos]),
                                  pool.slots(table, pos, pos + 1), bt, pool)
            out.append(int(logits[0].argmax()))
        return out

    assert run(False) != run(True)
