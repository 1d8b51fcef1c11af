"""Block tables beyond append: truncate (rollback) and fork (shared samples), run at random
against a real pool with the allocator's integrity, every block's refcount and every
sequence's K/V checked after each step; and the copy of a partial block, float and
quantized."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvferry.cache.block_table import fork, truncate
from kvferry.cache.budget import blocks_for_tokens
from kvferry.cache.pool import KvPool
from kvferry.errors import ResourceExhausted

BLOCK_SIZE = 4
NUM_BLOCKS = 24


def _pool(kv_cache_dtype: str = "auto", prefix_caching: bool = False) -> KvPool:
    return KvPool(num_layers=2, num_kv_heads=1, head_dim=2, block_size=BLOCK_SIZE,
                  num_blocks=NUM_BLOCKS, dtype=torch.float32, prefix_caching=prefix_caching,
                  kv_cache_dtype=kv_cache_dtype)


class TableMachine(RuleBasedStateMachine):
    """Sequences as (block table, K/V values by position). `write` appends positions, each
    holding a value no other write used, into blocks only this table holds, as a decode
    step may; `fork` and `truncate` are the operations under test; `free` ends a sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = _pool()
        self.seqs: list[tuple[list[int], list[float]]] = []
        self.next_value = 1.0

    def _write(self, table: list[int], values: list[float], n: int) -> None:
        end = len(values) + n
        need = blocks_for_tokens(end, BLOCK_SIZE) - len(table)
        table += self.pool.allocator.alloc(max(need, 0))
        for position in range(len(values), end):
            block = table[position // BLOCK_SIZE]
            assert self.pool.allocator.refcount(block) == 1, "a step writes a shared block"
            self.pool.cache[:, :, block, position % BLOCK_SIZE] = self.next_value
            values.append(self.next_value)
            self.next_value += 1

    @rule(n=st.integers(1, 9))
    def start(self, n: int) -> None:
        if blocks_for_tokens(n, BLOCK_SIZE) <= self.pool.allocator.num_free:
            table: list[int] = []
            values: list[float] = []
            self._write(table, values, n)
            self.seqs.append((table, values))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), n=st.integers(1, 6))
    def write(self, data: st.DataObject, n: int) -> None:
        table, values = data.draw(st.sampled_from(self.seqs))
        need = blocks_for_tokens(len(values) + n, BLOCK_SIZE) - len(table)
        if need <= self.pool.allocator.num_free:
            self._write(table, values, n)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def fork_one(self, data: st.DataObject) -> None:
        table, values = data.draw(st.sampled_from(self.seqs))
        at = data.draw(st.integers(0, len(values)))
        if at % BLOCK_SIZE and not self.pool.allocator.num_free:
            with pytest.raises(ResourceExhausted):
                fork(self.pool, table, at)
            return
        child = fork(self.pool, table, at)
        assert len(child) == blocks_for_tokens(at, BLOCK_SIZE)
        self.seqs.append((child, values[:at]))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def roll_back(self, data: st.DataObject) -> None:
        table, values = data.draw(st.sampled_from(self.seqs))
        at = data.draw(st.integers(0, len(values)))
        before = list(table)
        keep = blocks_for_tokens(at, BLOCK_SIZE)
        copies = bool(at % BLOCK_SIZE) and self.pool.allocator.refcount(before[keep - 1]) > 1
        if copies and self.pool.allocator.num_free + sum(
                self.pool.allocator.refcount(b) == 1 for b in before[keep:]) < 1:
            with pytest.raises(ResourceExhausted):
                truncate(self.pool, table, at)
            assert table == before
            return
        freed = truncate(self.pool, table, at)
        assert freed == before[keep:] and table[:keep - copies] == before[:keep - copies]
        assert (table[-1] != before[keep - 1]) if copies else table == before[:keep]
        del values[at:]

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.seqs) - 1))
        table, _ = self.seqs.pop(i)
        self.pool.allocator.free(table)

    @invariant()
    def integrity(self) -> None:
        report = self.pool.allocator.check_integrity()
        assert report.ok, report.error

    @invariant()
    def refcounts_are_the_tables_holding_each_block(self) -> None:
        held = Counter(block for table, _ in self.seqs for block in table)
        for block in range(NUM_BLOCKS):
            assert self.pool.allocator.refcount(block) == held[block], block

    @invariant()
    def every_sequence_reads_its_own_values(self) -> None:
        for table, values in self.seqs:
            assert len(table) >= blocks_for_tokens(len(values), BLOCK_SIZE)
            for position, value in enumerate(values):
                page = self.pool.cache[:, :, table[position // BLOCK_SIZE],
                                       position % BLOCK_SIZE]
                assert bool((page == value).all()), (position, value)


TableMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40,
                                          deadline=None)
test_truncate_and_fork_keep_the_pool_whole = TableMachine.TestCase


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8_e4m3"])
def test_a_forked_partial_block_is_an_exact_copy(kv_cache_dtype: str) -> None:
    pool = _pool(kv_cache_dtype)
    table = pool.allocator.alloc(3)
    generator = torch.Generator().manual_seed(0)
    pool.cache.copy_(torch.randint(0, 255, pool.cache.shape, generator=generator,
                                   dtype=torch.uint8).to(pool.cache.dtype)
                     if pool.is_quantized else torch.randn(pool.cache.shape,
                                                           generator=generator))
    child = fork(pool, table, 2 * BLOCK_SIZE + 1)
    assert child[:2] == table[:2] and child[2] not in table
    assert torch.equal(pool.cache[:, :, child[2]], pool.cache[:, :, table[2]])  # bytes
    assert torch.equal(pool.dense(pool.cache[:, :, child[2:]]),
                       pool.dense(pool.cache[:, :, table[2:]]))  # scales came along


def test_forking_at_a_block_boundary_copies_nothing() -> None:
    pool = _pool()
    table = pool.allocator.alloc(2)
    child = fork(pool, table, 2 * BLOCK_SIZE)
    assert child == table and pool.allocator.num_free == NUM_BLOCKS - 2


def test_a_fork_with_no_block_for_its_copy_changes_nothing() -> None:
    pool = _pool()
    table = pool.allocator.alloc(NUM_BLOCKS)
    with pytest.raises(ResourceExhausted):
        fork(pool, table, 5)
    assert all(pool.allocator.refcount(b) == 1 for b in table)


def test_truncating_a_shared_prefix_keeps_it_for_the_other_table() -> None:
    pool = _pool(prefix_caching=True)
    table = pool.allocator.alloc(3)
    child = fork(pool, table, 2 * BLOCK_SIZE)
    truncate(pool, child, 0)
    assert child == [] and all(pool.allocator.refcount(b) == 1 for b in table)
    with pytest.raises(ValueError):
        truncate(pool, table, 3 * BLOCK_SIZE + 1)  # past what the table holds


def test_rolling_back_into_a_shared_block_gives_the_table_its_own_copy() -> None:
    pool = _pool()
    table = pool.allocator.alloc(2)
    pool.cache[:, :, table[1]] = 7.0
    child = fork(pool, table, 2 * BLOCK_SIZE)  # both blocks shared
    truncate(pool, table, BLOCK_SIZE + 1)  # the next write goes to position 5
    assert table[0] == child[0] and table[1] != child[1]
    assert bool((pool.cache[:, :, table[1]] == 7.0).all())
    assert [pool.allocator.refcount(b) for b in (*child, table[1])] == [2, 1, 1]
