"""Preemption against an in-process decode engine: a sequence swapped out to host memory comes
back with its K/V bit for bit what it held before (decode_worker/steps.py `_swap_out` and
`_swap_in`), whatever the blocks it left were used for meanwhile, and decodes the same tokens
as on a pool large enough never to preempt."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from decode_worker.engine import DecodeEngine
from decode_worker.sequence import DecodeSeq, FinishedEvent, TokensEvent
from kvferry.model.config import load_model_config
from kvferry.model.sampling import FinishReason, SamplingParams
from kvferry.model.transformer import Transformer
from kvferry_kernels.dispatch import get_attention_backend
from tests.decode_worker.engines import cpu_engine, push_random_prompt
from tests.waiting import until, within

BLOCK_SIZE = 4
PROMPT = 10  # tokens; a reservation holds 3 blocks (the first decode slot included)
MAX_TOKENS = 12  # positions 0..20 are fed at most: 6 blocks
SMALL_POOL = 6  # A and B fill it at Reserve; A's growth swaps B out until A is done


@pytest.fixture(scope="module")
def model(qwen3_checkpoint: Path) -> Transformer:
    return Transformer(load_model_config(qwen3_checkpoint), get_attention_backend("torch"),
                       torch.float32, torch.device("cpu"))


def _engine(model: Transformer, num_blocks: int, stage_bytes: int = 0) -> DecodeEngine:
    return cpu_engine(model, BLOCK_SIZE, num_blocks, stage_bytes=stage_bytes)


def _push(engine: DecodeEngine, request_id: str, seed: int) -> None:
    push_random_prompt(engine, request_id, PROMPT, seed)


def _decode_both(engine: DecodeEngine) -> dict[str, list[int]]:
    """A (older) and B (newer) reserved, pushed and decoding together; their tokens."""
    async def run() -> dict[str, list[int]]:
        engine.start()
        try:
            for request_id, seed in (("A", 1), ("B", 2)):
                await engine.reserve(request_id, PROMPT, MAX_TOKENS, 30.0)
                _push(engine, request_id, seed)
            queues = {request_id: engine.attach(request_id, 7, SamplingParams(temperature=0.0),
                                                MAX_TOKENS - 1, [])
                      for request_id in ("A", "B")}
            tokens: dict[str, list[int]] = {}
            for request_id, queue in queues.items():
                tokens[request_id] = []
                while True:
                    event = await within(queue.get(), f"{request_id}'s next update")
                    if not isinstance(event, TokensEvent):
                        assert isinstance(event, FinishedEvent), event
                        assert event.reason is FinishReason.LENGTH
                        break
                    tokens[request_id] += event.token_ids

            def is_idle() -> bool:  # the loop's next pass found nothing to run
                stage = engine.steps.stage
                return not engine.steps.running and (stage is None or stage.capacity == (0, 0))

            await until(is_idle, "the step loop idle, its stage's memory given back")
            return tokens
        finally:
            await engine.stop()
    return asyncio.run(run())


def _bits(pages: torch.Tensor) -> torch.Tensor:
    return pages.view(torch.int32)  # float32 compared as raw bits (-0.0 != 0.0, NaN == NaN)


def test_swapped_kv_comes_back_bit_for_bit(model: Transformer) -> None:
    engine = _engine(model, SMALL_POOL)
    steps = engine.steps
    swap_out, swap_in = steps._swap_out, steps._swap_in
    held: dict[str, torch.Tensor] = {}  # request id -> its pages at swap-out
    # request id -> whether its pages were bit for bit the same right after swap-in (checked
    # here, not asserted: the step loop would turn an exception into a failed request)
    restored: dict[str, bool] = {}

    def spy_swap_out(seq: DecodeSeq) -> None:
        held[seq.request_id] = engine.pool.cache[:, :, seq.block_table].clone()
        left = list(seq.block_table)
        swap_out(seq)
        # Whatever the freed blocks hold from now on is not the swapped sequence's.
        engine.pool.cache[:, :, left] = torch.randn(engine.pool.cache[:, :, left].shape)

    def spy_swap_in() -> None:
        swap_in()
        for seq in steps.running:
            if seq.request_id in held and seq.request_id not in restored:
                # [layers, 2, blocks, block_size, kv_heads, head_dim]
                pages = engine.pool.cache[:, :, seq.block_table]
                restored[seq.request_id] = torch.equal(_bits(pages), _bits(held[seq.request_id]))

    steps._swap_out, steps._swap_in = spy_swap_out, spy_swap_in  # type: ignore[method-assign]
    got = _decode_both(engine)
    assert list(held) == ["B"]  # the newest was preempted
    assert restored == {"B": True}, "B's K/V changed across the swap"
    assert steps.num_preemptions == 1
    assert engine.pool.allocator.num_free == SMALL_POOL
    assert engine.pool.allocator.check_integrity().ok

    roomy = _engine(model, 4 * SMALL_POOL)
    assert _decode_both(roomy) == got
    assert roomy.steps.num_preemptions == 0
    assert all(len(tokens) == MAX_TOKENS - 1 for tokens in got.values())


def test_the_dense_stage_gives_the_same_tokens_and_its_memory_back_when_idle(
        model: Transformer) -> None:
    """The CPU path's dense K/V stage (preempting and not) decodes what the pages do, and an
    idle worker holds no stage rows once the stage's hold has run out: the step loop, idle,
    wakes to give their memory back."""
    want = _decode_both(_engine(model, 4 * SMALL_POOL))
    for num_blocks in (SMALL_POOL, 4 * SMALL_POOL):
        staged = _engine(model, num_blocks, stage_bytes=1 << 24)
        assert staged.steps.stage is not None
        staged.steps.stage.hold_s = 0.3  # (HOLD_S, 5 s: the test would wait that long idle)
        assert _decode_both(staged) == want
        assert staged.steps.stage is not None and staged.steps.stage.capacity == (0, 0)
        assert staged.steps.stage.num_gathered_tokens > 0  # the steps did run on the stage


def test_a_sequence_swapped_out_by_an_idle_reservation_resumes_when_it_is_aborted(
        model: Transformer) -> None:
    """A decodes alone; B's reservation (never pushed, as when the router aborts a request
    that waited for memory) takes the blocks A's growth needs, so A swaps itself out and the
    step loop has nothing left to run. Aborting B must wake the loop to swap A back in: a
    CI run once hung there until the client's deadline."""
    engine = _engine(model, SMALL_POOL)

    async def run() -> list[int]:
        engine.start()
        try:
            await engine.reserve("A", PROMPT, MAX_TOKENS, 30.0)
            _push(engine, "A", 1)
            queue = engine.attach("A", 7, SamplingParams(temperature=0.0), MAX_TOKENS - 1, [])
            await engine.reserve("B", PROMPT, MAX_TOKENS, 30.0)
            await until(lambda: engine.steps.swapped, "A swapped out")
            assert [s.request_id for s in engine.steps.swapped] == ["A"]
            assert not engine.steps.running
            engine.abort("B")
            tokens: list[int] = []
            while True:
                event = await within(queue.get(), "A's next update")
                if not isinstance(event, TokensEvent):
                    assert isinstance(event, FinishedEvent), event
                    assert event.reason is FinishReason.LENGTH
                    return tokens
                tokens += event.token_ids
        finally:
            await engine.stop()

    tokens = asyncio.run(run())
    assert len(tokens) == MAX_TOKENS - 1
    assert engine.steps.num_preemptions == 1
    assert engine.pool.allocator.num_free == SMALL_POOL
