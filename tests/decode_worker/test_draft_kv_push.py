"""A draft model's prompt K/V built by the prefill worker and pushed with the model's pages
(`--speculative-draft-kv ship`) into an in-process decode engine: the draft then starts after
the prompt (its catch-ups prefill only the tokens since), the output is the one decoding
without drafts gives and the drafts are those the recomputed draft K/V gives. Hostile or
incomplete draft pages are refused before any write, naming the field."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from decode_worker.engine import DecodeEngine
from decode_worker.spec.draft_model import DraftModel, draft_pool
from kvferry.cache.budget import blocks_for_tokens
from kvferry.cache.layout import KvLayout
from kvferry.cache.pool import KvPool
from kvferry.errors import DataLoss, InvalidArgument
from kvferry.model.config import load_model_config
from kvferry.model.sampling import SamplingParams
from kvferry.model.transformer import Transformer
from kvferry.settings import SpeculativeConfig
from kvferry.transfer import wire
from kvferry_kernels.dispatch import get_attention_backend
from prefill_worker.draft_kv import DraftPrefill
from tests.decode_worker.engines import collect_tokens, cpu_engine, run_to_idle

BLOCK_SIZE = 4
PROMPT = [5, 9, 13, 5, 9, 13, 7, 21, 40, 2, 9, 13, 5]  # 13 tokens: 4 blocks, the last partial
MAX_TOKENS = 20
GREEDY = SamplingParams(temperature=0.0)


def _load(path: Path) -> Transformer:
    return Transformer(load_model_config(path), get_attention_backend("torch"), torch.float32,
                       torch.device("cpu"))


@pytest.fixture(scope="module")
def model(qwen3_checkpoint: Path) -> Transformer:
    return _load(qwen3_checkpoint)


@pytest.fixture(scope="module")
def draft(draft_checkpoint: Path) -> Transformer:
    return _load(draft_checkpoint)


class PrefillSide:
    """What a prefill worker holds after PROMPT: the model's pages and the draft's (built by
    `DraftPrefill` in chunks of 4 positions), in blocks 0.. of pools of its own."""

    def __init__(self, model: Transformer, draft: Transformer) -> None:
        config = model.config
        self.num_blocks = blocks_for_tokens(len(PROMPT), BLOCK_SIZE)
        self.pool = KvPool(config.num_layers, config.num_kv_heads, config.head_dim, BLOCK_SIZE,
                           self.num_blocks, torch.float32, torch.device("cpu"))
        self.table = list(range(self.num_blocks))
        logits = model.prefill(torch.tensor(PROMPT), [len(PROMPT)],
                               self.pool.slots(self.table, 0, len(PROMPT)), self.pool)
        self.first = int(logits[0].argmax())
        self.layout = KvLayout.of_pool(self.pool, config.fingerprint)
        self.draft = DraftPrefill(draft, draft_pool(draft, self.pool), chunk_size=BLOCK_SIZE)
        self.draft.run(PROMPT, self.table)

    def chunks(self, is_draft: bool) -> list[tuple[wire.ChunkSpan, bytes, int]]:
        layout, pool = ((self.draft.layout, self.draft.pool) if is_draft
                        else (self.layout, self.pool))
        out = []
        for span in wire.plan_chunks(layout, len(PROMPT), target_bytes=2048):
            data = wire.pack_array(pool, self.table, span).tobytes()
            out.append((span, data, wire.crc32(data)))
        return out


def _engine(model: Transformer, draft: Transformer | None) -> DecodeEngine:
    if draft is None:
        return cpu_engine(model, BLOCK_SIZE, 40)
    config = model.config
    pool = KvPool(config.num_layers, config.num_kv_heads, config.head_dim, BLOCK_SIZE, 40,
                  torch.float32, torch.device("cpu"))
    return DecodeEngine(model, pool, KvLayout.of_pool(pool, config.fingerprint),
                        speculative=SpeculativeConfig("draft", 3, is_adaptive=False,
                                                      model="draft"),
                        draft=DraftModel(draft, draft_pool(draft, pool)))


def _push(engine: DecodeEngine, side: PrefillSide, with_draft: bool) -> None:
    """One push into reservation A: the model's pages, then the draft's."""
    receiver = engine.receiver
    epoch = receiver.begin_push("A")
    for chunk in side.chunks(False):
        receiver.receive_chunk("A", side.layout, len(PROMPT), *chunk, epoch)
    if with_draft:
        for chunk in side.chunks(True):
            receiver.receive_chunk("A", side.draft.layout, len(PROMPT), *chunk, epoch,
                                   is_draft=True)
    receiver.finish_push("A", epoch)


def _serve(engine: DecodeEngine, side: PrefillSide,
           push: Callable[[DecodeEngine], None]) -> list[int]:
    """Request A reserved, its K/V pushed by `push`, then decoded greedily to the end on
    the running engine; its tokens. Every block comes back, integrity holds."""
    async def run() -> list[int]:
        await engine.reserve("A", len(PROMPT), MAX_TOKENS, 30.0, PROMPT)
        push(engine)
        queue = engine.attach("A", side.first, GREEDY, MAX_TOKENS - 1, [])
        return await collect_tokens(queue, "A", [side.first])

    return run_to_idle(engine, run)


def test_shipped_draft_kv_starts_the_draft_after_the_prompt(model: Transformer,
                                                            draft: Transformer) -> None:
    side = PrefillSide(model, draft)
    want = _serve(_engine(model, None), side, lambda e: _push(e, side, with_draft=False))
    runs = {}
    for mode in ("recompute", "ship"):
        engine = _engine(model, draft)
        shipped = []

        def push(e: DecodeEngine, is_ship: bool = mode == "ship",
                 shipped: list[int] = shipped) -> None:
            _push(e, side, with_draft=is_ship)
            shipped.append(e._seqs["A"].draft_kv_tokens)

        tokens = _serve(engine, side, push)
        assert shipped == [len(PROMPT) if mode == "ship" else 0]
        drafting = engine.steps.drafting
        assert drafting is not None and drafting.draft is not None
        runs[mode] = (tokens, drafting.num_draft_tokens, drafting.num_accepted_tokens,
                      drafting.draft.num_prefill_tokens)
    for mode, (tokens, drafted, *_) in runs.items():
        assert tokens == want, mode
        assert drafted > 0, mode
    # The same drafts: the shipped draft K/V is what the decode worker would have computed.
    assert runs["ship"][1:3] == runs["recompute"][1:3]
    # Recompute prefilled the prompt and every kept token's position; ship only the latter.
    assert runs["recompute"][3] >= len(PROMPT)
    assert runs["ship"][3] <= len(want) < runs["recompute"][3]


def test_draft_prefill_in_chunks_equals_one_forward(model: Transformer,
                                                    draft: Transformer) -> None:
    side = PrefillSide(model, draft)  # chunks of 4: each attends over the ones before
    whole = DraftPrefill(draft, draft_pool(draft, side.pool), chunk_size=64)
    whole.run(PROMPT, side.table)
    torch.testing.assert_close(whole.pool.cache, side.draft.pool.cache, atol=1e-5, rtol=1e-5)


def test_a_decode_worker_without_a_draft_refuses_draft_pages(model: Transformer,
                                                             draft: Transformer) -> None:
    side = PrefillSide(model, draft)
    engine = _engine(model, None)

    def push(e: DecodeEngine) -> None:
        with pytest.raises(InvalidArgument) as refused:
            _push(e, side, with_draft=True)
        assert refused.value.field == "is_draft"
        e.receiver.fail_push("A")
        _push(e, side, with_draft=False)  # the model's pages alone: served

    assert len(_serve(engine, side, push)) == MAX_TOKENS


def test_hostile_draft_pages_are_refused(model: Transformer, draft: Transformer) -> None:
    side = PrefillSide(model, draft)
    good = side.chunks(True)
    engine = _engine(model, draft)
    assert engine.steps.drafting is not None and engine.steps.drafting.draft is not None
    draft_cache = engine.steps.drafting.draft.pool.cache
    before = draft_cache.clone()

    def push(e: DecodeEngine) -> None:
        receiver = e.receiver
        epoch = receiver.begin_push("A")
        with pytest.raises(InvalidArgument) as refused:  # the model's layout on a draft chunk
            receiver.receive_chunk("A", side.layout, len(PROMPT), *side.chunks(False)[0],
                                   epoch, is_draft=True)
        assert refused.value.field == "layout"
        span, data, _ = good[0]
        poisoned = bytearray(data)
        poisoned[:4] = torch.tensor([float("nan")]).numpy().tobytes()
        with pytest.raises(DataLoss):
            receiver.receive_chunk("A", side.draft.layout, len(PROMPT), span, bytes(poisoned),
                                   wire.crc32(bytes(poisoned)), epoch, is_draft=True)
        assert torch.equal(draft_cache, before)  # nothing written
        receiver.receive_chunk("A", side.draft.layout, len(PROMPT), *good[0], epoch,
                               is_draft=True)
        with pytest.raises(InvalidArgument) as refused:
            receiver.receive_chunk("A", side.draft.layout, len(PROMPT), *good[0], epoch,
                                   is_draft=True)
        assert refused.value.field == "block_start"
        for chunk in side.chunks(False):
            receiver.receive_chunk("A", side.layout, len(PROMPT), *chunk, epoch)
        with pytest.raises(InvalidArgument) as refused:  # the draft's pages, not all
            receiver.finish_push("A", epoch)
        assert refused.value.field == "is_draft" and len(good) > 1
        assert not e._seqs["A"].receipt.is_complete
        receiver.fail_push("A", epoch)
        _push(e, side, with_draft=True)  # again, whole: the draft starts after the prompt
        assert e._seqs["A"].draft_kv_tokens == len(PROMPT)

    assert len(_serve(engine, side, push)) == MAX_TOKENS
