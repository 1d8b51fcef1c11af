"""Dense K/V staging for the CPU decode path: the running batch's K/V, one contiguous row per
sequence, kept in step with the paged pool so that attention need not gather pages each step.

On a GPU the Triton kernel reads pages in place, and on CPU so does the C kernel over float32
pages (kernels/kvferry_kernels/cpu_attention.py; then a worker keeps no stage unless
--decode-stage-mib asks). Where neither can (quantized pages, no C compiler, or
KVFERRY_CPU_ATTENTION=torch), the torch path gathers every sequence's blocks into a padded
tensor on every step, a memory-bound copy of the whole batch's K/V per layer that costs as
much as the attention itself. The stage pays that copy once per sequence (when it joins the
batch) and then one slot per step: each step appends the new token's K/V here as well as to
the pool. The price: a joining long prompt's copy, and on growth every row's (those copies were
behind the slow gaps of long-prompt interference).

The paged pool stays the source of truth (transfers, preemption, integrity checks all use
it); the stage is a cache of it for the sequences now in the batch, rebuilt row by row when
the batch changes. It costs memory: layers x 2 x rows x KV heads x longest context x head
dim; past `budget_bytes` the engine falls back to the paged gather path.

Layout per layer: [rows, kv_heads, length, head_dim], the layout attention reads, so the
dense view of a batch is a plain slice.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from decode_worker.sequence import PagedSeq
from kvferry import trace
from kvferry.cache.pool import KvPool
from kvferry.settings import KERNEL_CACHE_DIR
from kvferry_kernels import cpu_attention
from kvferry_kernels.paged_attention_torch import dense_decode_attention

_LENGTH_GRAIN = 64  # tokens: capacity grows in steps of at least this
# Capacity this many times the batch's need is given back (resized to the need): a long
# request that left would otherwise make every later join zero rows of its length, and keep
# its memory. Growth doubles, so after a shrink the need must quarter again before the next.
_SHRINK_FACTOR = 4
# Seconds memory past the need (over _SHRINK_FACTOR times it, or any while idle) is kept: a
# closed loop's batch drains and refills at every wave, and giving the rows back at once made
# each refill allocate, fault in and copy them again (0.5-1.1 s a wave, 32 rows, real model).
HOLD_S = 5.0


class KvStage:
    """Rows of dense K/V for the sequences of the running batch. Executor thread only, but
    for park, idle_left_s and clear, which the step loop calls while no step runs."""

    def __init__(self, pool: KvPool, budget_bytes: int, hold_s: float = HOLD_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.pool = pool
        self.budget_bytes = budget_bytes
        self.hold_s = hold_s
        self._clock = clock
        self._parked_at: float | None = None  # when the batch went empty (park)
        self._oversized_since: float | None = None  # capacity past the need since then
        # Attention over each row's own length (kernels/kvferry_kernels/cpu_attention.py),
        # where it builds.
        self.kernel = None
        if (pool.cache.device.type == "cpu" and pool.dtype == torch.float32
                and cpu_attention.wanted()):
            self.kernel = cpu_attention.load(KERNEL_CACHE_DIR)
        self._seqs: list[PagedSeq] = []  # row i holds _seqs[i]
        self._valid: list[int] = []  # cache indices [0, valid) of row i hold its K/V
        # Row i's rotary shift as staged (rope position - cache index): K/V eviction changes it
        # as it drops a block and re-rotates the sinks, a re-base as it re-rotates every key.
        self._shifts: list[int] = []
        self._k: torch.Tensor | None = None  # [layers, rows, kv_heads, length, D]
        self._v: torch.Tensor | None = None
        self._rows_now = torch.arange(0)  # this step's rows, 0..B-1
        self._groups: list[tuple[tuple[int, int], int]] = []  # begin_step's runs of rows
        self._positions = torch.arange(0)  # this step's positions (its K/V slot)
        self.num_gathered_tokens = 0  # tokens copied in from the pool (joins, rebuilds)
        self.num_resizes = 0  # reallocations (growth, shrink): each copies every staged row

    @property
    def capacity(self) -> tuple[int, int]:
        """(rows, length) allocated."""
        return (0, 0) if self._k is None else (self._k.shape[1], self._k.shape[3])

    def nbytes(self, rows: int, length: int) -> int:
        p = self.pool
        return (2 * p.num_layers * rows * p.num_kv_heads * length * p.head_dim
                * p.dtype.itemsize)

    def clear(self) -> None:
        self._seqs, self._valid, self._shifts = [], [], []
        self._k = self._v = None
        self._parked_at = self._oversized_since = None

    def park(self) -> None:
        """The batch is empty: its rows hold nobody now, and the memory is kept for the next
        batch until `idle_left_s` runs out (then the caller clears)."""
        self._seqs, self._valid, self._shifts = [], [], []
        if self._k is not None and self._parked_at is None:
            self._parked_at = self._clock()

    def idle_left_s(self) -> float | None:
        """Seconds until a parked stage should be cleared (<= 0: now); None when not parked."""
        if self._parked_at is None:
            return None
        return self.hold_s - (self._clock() - self._parked_at)

    def arrange(self, batch: list[PagedSeq]) -> list[PagedSeq] | None:
        """Make the rows hold exactly `batch`, each row's K/V up to (not including) its next
        position. Returns the batch in row order (the order the step must use), or None when
        the stage would exceed its budget: then it is emptied and the caller uses pages."""
        tracer, started, gathered = trace.get(), time.monotonic(), self.num_gathered_tokens
        resizes = self.num_resizes
        arranged = self._arrange(batch)
        if tracer and self.num_gathered_tokens != gathered:  # rows copied in: a span
            tracer.event("stage", t0=started, t1=time.monotonic(),
                         tokens=self.num_gathered_tokens - gathered,
                         resized=self.num_resizes - resizes, shape=list(self.capacity))
        return arranged

    def _arrange(self, batch: list[PagedSeq]) -> list[PagedSeq] | None:
        self._parked_at = None
        # Room for every slot the block tables hold: the steps until the next arrange stay
        # inside them (the engine comes back to grow a table).
        need_rows = len(batch)
        need_length = max(max(len(s.block_table) * self.pool.block_size, s.cache_position + 1)
                          for s in batch)
        if self.nbytes(need_rows, need_length) > self.budget_bytes:
            self.clear()
            return None
        members = {id(s) for s in batch}
        i = 0
        while i < len(self._seqs):  # drop departed rows: the last row fills the hole
            if id(self._seqs[i]) in members:
                i += 1
                continue
            last = len(self._seqs) - 1
            if i != last:
                self._move(last, i)
            self._seqs.pop()
            self._valid.pop()
            self._shifts.pop()
        rows, length = self.capacity
        if need_rows > rows or need_length > length:
            self._grow(need_rows, need_length)
        elif self._held_long_enough(self.nbytes(rows, length)
                                    > _SHRINK_FACTOR * self.nbytes(need_rows, need_length)):
            self._resize(need_rows, -(-need_length // _LENGTH_GRAIN) * _LENGTH_GRAIN)
        staged = {id(s) for s in self._seqs}
        for seq in batch:
            if id(seq) not in staged:
                self._seqs.append(seq)
                self._valid.append(0)
                self._shifts.append(0)
        for row, seq in enumerate(self._seqs):
            if (self._valid[row] != seq.cache_position  # joined, out of step, or evicted
                    or self._shifts[row] != _shift(seq)):  # or re-based: copy in
                self._gather(row, seq)
        return list(self._seqs)

    def _held_long_enough(self, oversized: bool) -> bool:
        """Whether capacity past the need has been so for `hold_s`: time to give it back."""
        if not oversized:
            self._oversized_since = None
            return False
        now = self._clock()
        if self._oversized_since is None:
            self._oversized_since = now
        return now - self._oversized_since >= self.hold_s

    def _grow(self, need_rows: int, need_length: int) -> None:
        """Geometrically (fewer rebuilds), within the budget (which the need fits)."""
        rows, length = self.capacity
        rows = max(need_rows, 2 * rows) if need_rows > rows else rows
        if need_length > length:
            length = -(-max(need_length, 2 * length) // _LENGTH_GRAIN) * _LENGTH_GRAIN
        while self.nbytes(rows, length) > self.budget_bytes:
            if (rows, length) == (need_rows, need_length):
                break  # the need itself: begin_step's, which must go on
            if rows > need_rows:
                rows = max(need_rows, rows // 2)
            else:
                length = max(need_length, length // 2)
        self._resize(rows, length)

    def _resize(self, rows: int, length: int) -> None:
        """Reallocate to (rows, length), keeping the staged rows (there are at most `rows`,
        each valid within `length`)."""
        self.num_resizes += 1
        self._oversized_since = None
        p = self.pool
        shape = (p.num_layers, rows, p.num_kv_heads, length, p.head_dim)
        # The kernel reads no row past its length, so only the torch path needs zeros there.
        new = torch.empty if self.kernel is not None else torch.zeros
        k = new(shape, dtype=p.dtype, device=p.cache.device)
        v = new(shape, dtype=p.dtype, device=p.cache.device)
        if self._k is not None and self._v is not None and self._seqs:
            n, old = len(self._seqs), min(self._k.shape[3], length)
            k[:, :n, :, :old] = self._k[:, :n, :, :old]
            v[:, :n, :, :old] = self._v[:, :n, :, :old]
        self._k, self._v = k, v

    def _move(self, src: int, dst: int) -> None:
        assert self._k is not None and self._v is not None  # noqa: S101 - rows exist
        n = self._valid[src]
        self._k[:, dst, :, :n] = self._k[:, src, :, :n]
        self._v[:, dst, :, :n] = self._v[:, src, :, :n]
        self._clear_tail(dst, n)
        self._seqs[dst], self._valid[dst] = self._seqs[src], n
        self._shifts[dst] = self._shifts[src]

    def _clear_tail(self, row: int, n: int) -> None:
        """Zero `row` past position `n`: attention gives those positions probability 0, which
        cancels only finite values (0 x NaN is NaN), and the row's previous holder may have
        left anything there. The kernel never reads there: nothing to do."""
        assert self._k is not None and self._v is not None  # noqa: S101 - rows exist
        if self.kernel is not None:
            return
        self._k[:, row, :, n:] = 0
        self._v[:, row, :, n:] = 0

    def _gather(self, row: int, seq: PagedSeq) -> None:
        """Copy cache indices [0, cache_position) of `seq` from its pages into `row`."""
        assert self._k is not None and self._v is not None  # noqa: S101 - sized by arrange
        n = seq.cache_position
        p = self.pool
        blocks = -(-n // p.block_size)
        ids = torch.tensor(seq.block_table[:blocks], device=p.cache.device)
        # [layers, 2, blocks, block_size, kv_heads, D] -> [layers, 2, kv_heads, n, D]
        pages = p.dense(p.cache.index_select(2, ids)).flatten(2, 3)[:, :, :n].transpose(2, 3)
        self._k[:, row, :, :n] = pages[:, 0]
        self._v[:, row, :, :n] = pages[:, 1]
        self._clear_tail(row, n)
        self._valid[row] = n
        self._shifts[row] = _shift(seq)
        self.num_gathered_tokens += n

    # ---- one step ----------------------------------------------------------------------------
    def begin_step(self, positions: torch.Tensor) -> None:
        """The batch (rows 0..B-1, as `arrange` ordered it) feeds tokens whose K/V goes to
        cache indices `positions` (their text positions, unless a sequence evicted)."""
        if len(positions) and int(positions.max()) >= self.capacity[1]:  # a caller that
            self._grow(len(positions), int(positions.max()) + 1)  # grew a table meanwhile
        self._rows_now = torch.arange(len(positions), device=positions.device)
        self._positions = positions
        self._groups = _length_groups([int(p) + 1 for p in positions.tolist()])

    def end_step(self) -> None:
        """Every row now holds its K/V up to and including the position just fed."""
        for row in range(len(self._positions)):
            self._valid[row] += 1

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               seq_lens: torch.Tensor, sm_scale: float) -> torch.Tensor:
        """Append this step's K/V ([B, kv_heads, D]) of `layer`, then attend over the rows."""
        assert self._k is not None and self._v is not None  # noqa: S101 - sized by arrange
        self._k[layer, self._rows_now, :, self._positions] = k
        self._v[layer, self._rows_now, :, self._positions] = v
        if self.kernel is not None:  # one call, each row over its own length
            rows = len(self._positions)
            return self.kernel(q, self._k[layer, :rows], self._v[layer, :rows], seq_lens,
                               sm_scale)
        if len(self._groups) == 1:
            (start, end), length = self._groups[0]
            return dense_decode_attention(q, self._k[layer, :end, :, :length],
                                          self._v[layer, :end, :, :length], seq_lens, sm_scale)
        out = torch.empty_like(q)
        for (start, end), length in self._groups:  # each run of rows over its own length
            out[start:end] = dense_decode_attention(
                q[start:end], self._k[layer, start:end, :, :length],
                self._v[layer, start:end, :, :length], seq_lens[start:end], sm_scale)
        return out


def reads_pages_in_place(device: torch.device, kv_dtype: str) -> bool:
    """Whether the torch backend's CPU decode attention reads the pool's pages in place (float32
    pages, and the C kernel builds here): then no dense stage is kept by default
    (--decode-stage-mib). Quantized pages keep it: it holds them dequantized."""
    return (device.type == "cpu" and kv_dtype == "float32" and cpu_attention.wanted()
            and cpu_attention.load(KERNEL_CACHE_DIR) is not None)


def stage_bytes_for_pool(pool: KvPool) -> int:
    """The stage's default budget: every token the pool holds, staged densely in the model's
    dtype. The stage mirrors the running batch, which never holds more tokens than the pool;
    a smaller budget (256 MiB before) made a closed loop of 32 requests on the real model
    leave the stage and come back every few hundred steps, each return a full re-stage."""
    tokens = pool.num_blocks * pool.block_size
    return (2 * pool.num_layers * tokens * pool.num_kv_heads * pool.head_dim
            * pool.dtype.itemsize)


LONG_ROW_FACTOR = 4  # a row this many times longer than the batch's median is attended alone
LONG_ROW_MIN = 256  # tokens: shorter rows are never worth a call of their own


def _length_groups(lengths: list[int]) -> list[tuple[tuple[int, int], int]]:
    """Runs of rows ((start, end), length to attend over). One run over the longest length,
    unless some rows are far longer than the median: padding every row to a long prompt's
    context (one 3,000-token request among 50-token ones) multiplied the step's attention by
    the batch size. Then each long row is a run of its own and the rows between them runs
    over their own longest length. Rows stay in place: every run is a slice, nothing copies."""
    if not lengths:
        return [((0, 0), 1)]
    median = sorted(lengths)[(len(lengths) - 1) // 2]  # the lower median
    limit = max(LONG_ROW_FACTOR * median, LONG_ROW_MIN)
    if max(lengths) <= limit:
        return [((0, len(lengths)), max(lengths))]
    groups, start = [], 0
    for row, length in enumerate(lengths):
        if length > limit:
            if row > start:
                groups.append(((start, row), max(lengths[start:row])))
            groups.append(((row, row + 1), length))
            start = row + 1
    if start < len(lengths):
        groups.append(((start, len(lengths)), max(lengths[start:])))
    return groups


def _shift(seq: PagedSeq) -> int:
    """How far `seq`'s rotary positions run ahead of its cache indices (0 unless it evicted)."""
    return seq.rope_position - seq.cache_position
