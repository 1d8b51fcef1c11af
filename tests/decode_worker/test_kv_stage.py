"""The dense K/V stage against the paged pool: through joins, departures, growth past its
capacity and the budget fallback, attention over the stage equals the per-sequence reference
over the pages, step after step."""

from __future__ import annotations

import random

import pytest
import torch

from decode_worker.kv_stage import HOLD_S, KvStage, stage_bytes_for_pool
from decode_worker.sequence import PlainSeq, step_inputs
from kvferry.cache.pool import KvPool
from kvferry_kernels.cpu_attention import CPU_ATTENTION_ENV
from kvferry_kernels.paged_attention_ref import paged_decode_attention_ref, write_kv_ref

LAYERS, HQ, HKV, D, BS = 2, 4, 2, 16, 4


@pytest.fixture(autouse=True, params=["kernel", "torch"])
def attention_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test on both attention paths: the C kernel (kernels/kvferry_kernels/cpu_attention.py)
    and the torch ops."""
    if request.param == "torch":
        monkeypatch.setenv(CPU_ATTENTION_ENV, "torch")
    else:
        monkeypatch.delenv(CPU_ATTENTION_ENV, raising=False)
    return request.param


def test_the_kernel_is_used_unless_torch_is_asked_for(attention_path: str) -> None:
    assert (KvStage(_pool(8), 1 << 20).kernel is not None) == (attention_path == "kernel")




def _pool(num_blocks: int = 2048) -> KvPool:
    pool = KvPool(LAYERS, HKV, D, BS, num_blocks, torch.float32, torch.device("cpu"))
    pool.cache.normal_(generator=torch.Generator().manual_seed(0))
    pool.cache[:, :, -1] = float("nan")  # a poisoned block nobody owns
    return pool


def _new_seq(pool: KvPool, free: list[int], length: int) -> PlainSeq:
    """A sequence whose first `length` positions are already in (random) pages."""
    blocks = [free.pop() for _ in range(-(-(length + 1) // BS))]
    return PlainSeq(blocks, length)


def _step(pool: KvPool, stage: KvStage, batch: list[PlainSeq], free: list[int],
          gen: torch.Generator) -> None:
    """One decode step of `batch` (in stage order): write each layer's new K/V to the pages
    and compare stage attention with the reference over the pages."""
    for seq in batch:  # the slot this step writes
        if len(seq.block_table) * BS <= seq.next_position:
            seq.block_table.append(free.pop())
    positions, slots, table, _ = step_inputs(batch, BS)
    seq_lens = (positions + 1).to(torch.int32)
    stage.begin_step(positions)
    for layer in range(LAYERS):
        q = torch.randn(len(batch), HQ, D, generator=gen)
        k = torch.randn(len(batch), HKV, D, generator=gen)
        v = torch.randn(len(batch), HKV, D, generator=gen)
        write_kv_ref(k, v, pool.k_cache(layer), pool.v_cache(layer), slots)
        got = stage.attend(layer, q, k, v, seq_lens, D**-0.5)
        want = paged_decode_attention_ref(q, pool.k_cache(layer), pool.v_cache(layer), table,
                                          seq_lens, D**-0.5)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    stage.end_step()
    for seq in batch:
        seq.next_position += 1


def test_stage_follows_the_pages_through_joins_and_departures() -> None:
    pool = _pool()
    free = list(range(pool.num_blocks - 1))
    rng, gen = random.Random(1), torch.Generator().manual_seed(1)
    stage = KvStage(pool, budget_bytes=1 << 30)
    running = [_new_seq(pool, free, rng.randint(1, 20)) for _ in range(3)]
    for step in range(60):
        if step % 5 == 0 and running:  # departures, from anywhere in the rows
            for seq in rng.sample(running, rng.randint(0, min(2, len(running)))):
                running.remove(seq)
                free.extend(seq.block_table)
        if step % 3 == 0:  # joins, some with contexts past the stage's current length
            running += [_new_seq(pool, free, rng.randint(1, 90)) for _ in range(rng.randint(0, 3))]
        if not running:
            continue
        batch = stage.arrange(running)
        assert batch is not None and {id(s) for s in batch} == {id(s) for s in running}
        _step(pool, stage, batch, free, gen)
    rows, length = stage.capacity
    assert rows >= 1 and length % 64 == 0
    # Joins copied each sequence in once; steady steps copy nothing.
    gathered = stage.num_gathered_tokens
    batch = stage.arrange(running)
    assert batch is not None
    _step(pool, stage, batch, free, gen)
    assert stage.num_gathered_tokens == gathered


@pytest.mark.parametrize("lengths", [
    [40, 3000, 30, 50, 45],  # one long prompt among short ones, in the middle
    [3000, 20, 2900, 25],  # two, first and third
    [30, 40, 50, 2000],  # last
])
def test_long_rows_are_attended_over_their_own_length(lengths: list[int]) -> None:
    """A batch mixing a long context with short ones: the long rows run alone and the rest
    over their own longest length (padding every row to the long one multiplied
    the step), with the same results as the pages."""
    pool = _pool(num_blocks=3000)
    free = list(range(pool.num_blocks - 1))
    gen = torch.Generator().manual_seed(3)
    stage = KvStage(pool, budget_bytes=1 << 30)
    running = [_new_seq(pool, free, n) for n in lengths]
    batch = stage.arrange(running)
    assert batch is not None
    for _ in range(3):
        _step(pool, stage, batch, free, gen)
    longest = max(lengths) + 3
    assert max(length for _, length in stage._groups) == longest
    assert len(stage._groups) > 1  # not one run padded to the longest
    assert sum(end - start for (start, end), _ in stage._groups) == len(lengths)


@pytest.mark.parametrize("lengths, groups", [
    ([10, 20, 30], [((0, 3), 30)]),
    ([100, 300, 200], [((0, 3), 300)]),  # under LONG_ROW_MIN: one run
    ([40, 3000, 30, 50], [((0, 1), 40), ((1, 2), 3000), ((2, 4), 50)]),
    ([3000, 20], [((0, 1), 3000), ((1, 2), 20)]),
    ([], [((0, 0), 1)]),
])
def test_length_groups(lengths: list[int], groups: list) -> None:
    from decode_worker.kv_stage import _length_groups

    assert _length_groups(lengths) == groups


def test_over_budget_falls_back_then_rebuilds() -> None:
    pool = _pool()
    free = list(range(pool.num_blocks - 1))
    gen = torch.Generator().manual_seed(2)
    small = [_new_seq(pool, free, 10) for _ in range(2)]
    budget = KvStage(pool, 0).nbytes(2, 64)  # two rows of 64 positions
    stage = KvStage(pool, budget)
    batch = stage.arrange(small)
    assert batch is not None
    _step(pool, stage, batch, free, gen)
    big = small + [_new_seq(pool, free, 100)]
    assert stage.arrange(big) is None  # would not fit: the caller gathers pages
    assert stage.capacity == (0, 0)
    batch = stage.arrange(small)  # fits again: rebuilt from the pages, still exact
    assert batch is not None
    _step(pool, stage, batch, free, gen)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_capacity_far_past_the_need_is_given_back_after_the_hold() -> None:
    """A long request grew the rows; once it leaves, the short rows that stay are resized to
    their need once that has lasted HOLD_S (a join would otherwise zero rows of the long
    length, and the memory stayed held for good: the soak's RSS check caught it), keeping
    their K/V exact; a need within 4x of the capacity keeps it (no resize back and forth)."""
    pool = _pool(num_blocks=1200)
    free = list(range(pool.num_blocks - 1))
    gen = torch.Generator().manual_seed(4)
    clock = Clock()
    stage = KvStage(pool, budget_bytes=1 << 30, clock=clock)
    short = [_new_seq(pool, free, n) for n in (10, 30, 20)]
    long = _new_seq(pool, free, 2000)
    batch = stage.arrange(short + [long])
    assert batch is not None
    _step(pool, stage, batch, free, gen)
    grown = stage.capacity
    assert grown[1] >= 2001
    for _ in range(2):  # the long one left; within the hold the capacity stays
        batch = stage.arrange(short)
        assert batch is not None and stage.capacity == grown
        _step(pool, stage, batch, free, gen)
        clock.now += HOLD_S / 2 - 0.25  # exact in binary: 4.5 s after the two
    clock.now += 0.5
    batch = stage.arrange(short)
    assert batch is not None and stage.capacity == (3, 64)
    _step(pool, stage, batch, free, gen)  # the kept rows still equal the pages
    clock.now += 10 * HOLD_S
    batch = stage.arrange(short[:2])  # 2 rows of 64 are not a quarter of 3 x 64: kept
    assert batch is not None and stage.capacity == (3, 64)
    _step(pool, stage, batch, free, gen)


def test_a_parked_stage_keeps_its_memory_for_the_next_batch_until_the_hold_runs_out() -> None:
    """The batch went empty (a closed loop between waves): the rows hold nobody, and the next
    batch within HOLD_S is staged into the same memory with no resize, even while it is far
    smaller than the capacity; once a park lasts HOLD_S, idle_left_s says clear."""
    pool = _pool()
    free = list(range(pool.num_blocks - 1))
    gen = torch.Generator().manual_seed(5)
    clock = Clock()
    stage = KvStage(pool, budget_bytes=1 << 30, clock=clock)
    assert stage.idle_left_s() is None
    wave = [_new_seq(pool, free, 20 + i) for i in range(8)]
    assert stage.arrange(wave) is not None
    capacity, resizes = stage.capacity, stage.num_resizes
    stage.park()
    clock.now += 1.0
    stage.park()  # parked already: the hold still counts from the first
    assert stage.idle_left_s() == pytest.approx(HOLD_S - 1.0)
    for size in range(1, 9):  # the next wave joins one at a time, in fresh pages
        batch = stage.arrange([_new_seq(pool, free, 30 + i) for i in range(size)])
        assert batch is not None and stage.capacity == capacity
        assert stage.idle_left_s() is None  # staging again: not parked
        _step(pool, stage, batch, free, gen)
        clock.now += 0.5
    assert stage.num_resizes == resizes
    stage.park()
    clock.now += HOLD_S
    assert stage.idle_left_s() == pytest.approx(0.0)
    stage.clear()
    assert stage.capacity == (0, 0) and stage.idle_left_s() is None


def test_a_reused_row_keeps_nothing_of_its_previous_holder() -> None:
    """A sequence whose K/V went NaN leaves the batch; a shorter one takes its row while a
    long one keeps the batch's length past it. Attention masks the positions past the
    newcomer's length, which cancels only finite values, so the row must hold none of the
    old NaN there: the newcomer's attention stays exact."""
    pool = _pool()
    free = list(range(pool.num_blocks - 1))
    gen = torch.Generator().manual_seed(3)
    long, poisoned = _new_seq(pool, free, 40), _new_seq(pool, free, 40)
    for block in poisoned.block_table:
        pool.cache[:, :, block] = float("nan")
    stage = KvStage(pool, budget_bytes=1 << 30)
    assert stage.arrange([long, poisoned]) == [long, poisoned]
    short = _new_seq(pool, free, 5)
    batch = stage.arrange([long, short])  # `short` takes the poisoned sequence's row
    assert batch == [long, short]
    _step(pool, stage, batch, free, gen)  # compares with the reference over the pages
    extra = _new_seq(pool, free, 3)  # `long` leaves: the last row moves into its place
    batch = stage.arrange([short, extra])
    assert batch is not None
    _step(pool, stage, batch, free, gen)


@pytest.mark.parametrize("num_tokens", [1, 37])
def test_decode_with_stage_matches_decode_over_pages(num_tokens: int, qwen3_checkpoint
                                                     ) -> None:
    """The model's decode steps give the same logits from the stage as from the pages."""
    from kvferry.model.config import load_model_config
    from kvferry.model.transformer import Transformer
    from kvferry_kernels.dispatch import get_attention_backend

    config = load_model_config(qwen3_checkpoint)
    model = Transformer(config, get_attention_backend("torch"))
    pool = KvPool(config.num_layers, config.num_kv_heads, config.head_dim, BS, 64,
                  torch.float32, torch.device("cpu"))
    free = list(range(64))
    seqs, tokens = [], {}
    for prompt in ([5, 9], [1, 2, 3, 4, 5, 6, 7], [11, 12, 13]):
        seq = PlainSeq([free.pop() for _ in range(-(-(len(prompt) + num_tokens) // BS))],
                  len(prompt))
        logits = model.prefill(torch.tensor(prompt), [len(prompt)],
                               pool.slots(seq.block_table, 0, len(prompt)), pool)
        tokens[id(seq)] = int(logits[0].argmax())
        seqs.append(seq)
    stage = KvStage(pool, 1 << 30)
    for _ in range(num_tokens):
        batch = stage.arrange(seqs)
        assert batch is not None
        positions, slots, table, _ = step_inputs(batch, BS)
        ids = torch.tensor([tokens[id(s)] for s in batch])
        snapshot = pool.cache.clone()
        paged = model.decode(ids, positions, slots, table, pool)
        pages_after = pool.cache.clone()
        pool.cache.copy_(snapshot)
        staged = model.decode(ids, positions, slots, table, pool, stage)
        # The pages are written all the same (up to rounding: the attention math differs).
        torch.testing.assert_close(pool.cache, pages_after, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(staged, paged, atol=1e-5, rtol=1e-5)
        assert torch.equal(staged.argmax(-1), paged.argmax(-1))
        for row, seq in enumerate(batch):
            tokens[id(seq)] = int(staged[row].argmax())
            seq.next_position += 1


def test_the_default_budget_stages_every_token_the_pool_holds() -> None:
    pool = _pool(65)  # 64 blocks to hand out, and the poisoned one
    budget = stage_bytes_for_pool(pool)
    assert budget == KvStage(pool, 0).nbytes(1, 65 * BS)
    free = list(range(64))
    seqs = [PlainSeq([free.pop() for _ in range(16)], 16 * BS - 1) for _ in range(4)]
    assert KvStage(pool, budget).arrange(seqs) is not None  # 4 rows of 64: the whole pool
    assert KvStage(pool, KvStage(pool, 0).nbytes(4, 16 * BS) - 1).arrange(seqs) is None
