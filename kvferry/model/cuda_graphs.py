"""The decode step replayed from CUDA graphs, one graph per batch-size bucket (on by default
on CUDA, as in vLLM; `--cuda-graphs off` is vLLM's `--enforce-eager`).

A graph replays fixed kernels on fixed addresses, so each bucket of S rows owns a static
copy of everything its step reads and writes (`StaticInputs`): token ids, positions, slot
mapping, block tables [S, max_blocks], context lengths, the Triton split-KV workspace and
attention output (shared by the layers: they run one after another on one stream), and the
logits the capture produced. `prepare` copies a step's B <= S rows into them. The S - B
padded rows feed token 0 at position 0, write their K/V to the scratch block's first slot
and attend over that one slot (context length 1): finite, and never in a block a sequence
owns. The scratch block is taken from the pool's allocator when the graphs are built (so
no request is ever given it) and given back by `release`.

max_blocks, the block-table width every graph is captured with, is the most blocks one
sequence can hold: the model's context (max_position_embeddings) in blocks, and at most
every block of the pool but the scratch one. The Triton kernels' grid and split count
depend on S and that width only, never on the lengths, which is what makes them capturable;
the torch attention backend reads lengths on the host and cannot be captured.

A step runs eagerly (the call returns None) when its batch is above the largest bucket,
its block table is wider than max_blocks, its pool is not the graphs' pool, its bucket is
not captured, or the device is not CUDA. Everything but the capture runs on any device:
`run_body` is the captured function itself, callable on the static buffers directly, which
is how the CPU tests check the graph's math against the eager step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

from kvferry.cache.pool import KvPool
from kvferry.model.compiled import smallest_bucket

if TYPE_CHECKING:
    from kvferry.model.transformer import Transformer
    from kvferry_kernels.triton_paged_attention import DecodeWorkspace

log = logging.getLogger("kvferry.cuda_graphs")


class StaticInputs(NamedTuple):
    """One bucket's buffers: everything its graph reads, at addresses fixed for its life."""

    token_ids: torch.Tensor  # [S] int64; padded rows: 0
    positions: torch.Tensor  # [S] int64; padded rows: 0
    slot_mapping: torch.Tensor  # [S] int64; padded rows: the scratch block's first slot
    block_tables: torch.Tensor  # [S, max_blocks] int32; padding (rows and columns): scratch
    seq_lens: torch.Tensor  # [S] int32: positions + 1; padded rows: 1
    attn_out: torch.Tensor  # [S, Hq, D] model dtype: Triton's output, each layer in turn
    workspace: DecodeWorkspace | None  # Triton's split-KV partials; None: torch backend
    run_rows: torch.Tensor | None  # [S] int32 (model.query_runs): each row's run; padded: 1


class _Captured(NamedTuple):
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # [S, vocab] float32, rewritten by every replay


def max_blocks_per_seq(max_context: int, block_size: int, num_pool_blocks: int) -> int:
    """The block-table width graphs are captured with: a sequence of the model's whole
    context, or of every pool block but the scratch one, whichever is fewer blocks."""
    if num_pool_blocks < 2:
        raise ValueError(f"cuda_graphs: the pool needs >= 2 blocks (one is the scratch "
                         f"block), got {num_pool_blocks}")
    return max(1, min(-(-max_context // block_size), num_pool_blocks - 1))


class CudaGraphDecode:
    """The decode step of one Transformer over one pool, per batch-size bucket. Owns the
    buckets' static buffers, their graphs and the pool's scratch block."""

    def __init__(self, model: Transformer, pool: KvPool, buckets: Sequence[int],
                 max_blocks: int | None = None) -> None:
        if not buckets or min(buckets) < 1:
            raise ValueError(f"cuda_graphs: buckets must be >= 1, got {list(buckets)}")
        self.model = model
        self.pool = pool
        self.device = model.device
        self.buckets = tuple(sorted(set(buckets)))
        self.max_blocks = max_blocks or max_blocks_per_seq(
            model.config.max_position_embeddings, pool.block_size, pool.num_blocks)
        self._fixed_attention: Callable[..., torch.Tensor] | None = None
        if model.backend.name == "triton":
            from kvferry_kernels.triton_paged_attention import paged_decode_attention_triton

            self._fixed_attention = paged_decode_attention_triton
        self.scratch_block: int | None = pool.allocator.alloc(1)[0]
        pool.num_internal_blocks += 1  # no request's: stats and admission leave it out
        self.scratch_slot = self.scratch_block * pool.block_size
        self._static = {size: self._alloc(size) for size in self.buckets}
        self._captured: dict[int, _Captured] = {}
        self._mempool: tuple[int, int] | None = None  # one graph memory pool for all buckets
        self.num_replays = 0  # steps replayed from a graph
        self.num_eager = 0  # steps declined (they ran compiled or eagerly)
        self.capture_s = 0.0

    def _alloc(self, size: int) -> StaticInputs:
        cfg, dev = self.model.config, self.device
        workspace = None
        if self._fixed_attention is not None:
            from kvferry_kernels.triton_paged_attention import (
                alloc_decode_workspace,
                default_num_splits,
            )

            splits = default_num_splits(size, cfg.num_kv_heads,
                                        self.max_blocks * self.pool.block_size,
                                        self.model.dtype, dev)
            workspace = alloc_decode_workspace(size, cfg.num_heads, cfg.num_kv_heads,
                                               cfg.head_dim, splits, dev)
        return StaticInputs(
            token_ids=torch.zeros(size, dtype=torch.int64, device=dev),
            positions=torch.zeros(size, dtype=torch.int64, device=dev),
            slot_mapping=torch.full((size,), self.scratch_slot, dtype=torch.int64, device=dev),
            block_tables=torch.full((size, self.max_blocks), self.scratch_block,
                                    dtype=torch.int32, device=dev),  # [S, max_blocks]
            seq_lens=torch.ones(size, dtype=torch.int32, device=dev),
            run_rows=(torch.ones(size, dtype=torch.int32, device=dev)
                      if self.model.takes_run_rows else None),
            attn_out=torch.zeros(size, cfg.num_heads, cfg.head_dim, dtype=self.model.dtype,
                                 device=dev),  # [S, Hq, D]
            workspace=workspace,
        )

    def static(self, size: int) -> StaticInputs:
        """Bucket `size`'s buffers (read by tests and benchmarks; written by `prepare`)."""
        return self._static[size]

    def bucket(self, batch: int) -> int | None:
        """The smallest bucket that holds `batch` rows, or None."""
        return smallest_bucket(self.buckets, batch)

    def covers(self, batch: int, width: int) -> int | None:
        """The bucket a step of `batch` rows with `width`-block tables runs in, or None
        (eager): the batch is above every bucket or the tables are wider than max_blocks."""
        return self.bucket(batch) if width <= self.max_blocks else None

    def prepare(self, token_ids: torch.Tensor, positions: torch.Tensor,
                slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                seq_lens: torch.Tensor | None = None) -> int | None:
        """Copy one step's inputs (as `Transformer.decode` takes them) into its bucket's
        buffers, padded; the bucket, or None where no bucket covers the step."""
        batch, width = block_tables.shape
        size = self.covers(batch, width)
        if size is not None:
            self._copy_in(self._static[size], token_ids, positions, slot_mapping, block_tables,
                          positions + 1 if seq_lens is None else seq_lens)
        return size

    def _copy_in(self, s: StaticInputs, token_ids: torch.Tensor, positions: torch.Tensor,
                 slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor) -> None:
        batch, width = block_tables.shape
        s.token_ids[:batch].copy_(token_ids)
        s.positions[:batch].copy_(positions)
        s.seq_lens[:batch].copy_(seq_lens)
        s.slot_mapping[:batch].copy_(slot_mapping)
        s.block_tables[:batch, :width].copy_(block_tables)
        s.block_tables[:batch, width:].fill_(self.scratch_block)
        self._pad_rows(s, batch)
        if s.run_rows is not None:  # padded rows (scratch table, length 1) each stand alone
            s.run_rows.copy_(self.model.run_rows(s.block_tables, s.seq_lens)["run_rows"])

    def _pad_rows(self, s: StaticInputs, first: int) -> None:
        """Rows [first, S) become padding: token 0 at position 0 over the scratch block."""
        s.token_ids[first:].zero_()
        s.positions[first:].zero_()
        s.seq_lens[first:].fill_(1)
        s.slot_mapping[first:].fill_(self.scratch_slot)
        s.block_tables[first:].fill_(self.scratch_block)
        if s.run_rows is not None:
            s.run_rows[first:].fill_(1)

    @torch.inference_mode()
    def run_body(self, size: int) -> torch.Tensor:  # [S, vocab] float32
        """The function each graph captures: the model's decode forward over bucket `size`'s
        buffers, writing K/V at their slots. Runs uncaptured on any device too."""
        s, model, pool = self._static[size], self.model, self.pool

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                   ) -> torch.Tensor:
            args = (q, pool.k_cache(layer), pool.v_cache(layer), s.block_tables, s.seq_lens,
                    model.sm_scale)
            if self._fixed_attention is None:
                return model.backend.decode_attention(*args)
            runs = {} if s.run_rows is None else {"run_rows": s.run_rows}
            return self._fixed_attention(*args, workspace=s.workspace, out=s.attn_out, **runs)

        return model.forward_tokens(model.weights, model.inv_freq, s.token_ids, s.positions,
                                    model.writing(attend, s.slot_mapping, pool))

    def capture(self, size: int) -> None:
        """Capture bucket `size`'s graph, its rows all padding (so capturing writes nothing
        but the scratch block). Needs CUDA and a backend that never syncs (Triton)."""
        if self.device.type != "cuda" or self._fixed_attention is None:
            raise ValueError(f"cuda_graphs: capture needs a CUDA device and the triton "
                             f"backend, got {self.device} and {self.model.backend.name}")
        if self.scratch_block is None:
            raise ValueError("cuda_graphs: released; build a new CudaGraphDecode")
        self._pad_rows(self._static[size], 0)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):  # Triton compiles and cuBLAS picks kernels outside the capture
                self.run_body(size)
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self._mempool is None:
            self._mempool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._mempool):
            logits = self.run_body(size)
        self._captured[size] = _Captured(graph, logits)

    def capture_all(self) -> None:
        """Capture every bucket, largest first (the smaller ones reuse its memory pool)."""
        start = time.perf_counter()
        for size in reversed(self.buckets):
            self.capture(size)
        torch.cuda.synchronize(self.device)
        self.capture_s = time.perf_counter() - start
        log.info("decode step captured in CUDA graphs for batch sizes %s (block tables of %d "
                 "blocks) in %.1f s", ",".join(map(str, self.buckets)), self.max_blocks,
                 self.capture_s)

    @property
    def captured_sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self._captured))

    def __call__(self, token_ids: torch.Tensor, positions: torch.Tensor,
                 slot_mapping: torch.Tensor, block_tables: torch.Tensor, pool: KvPool,
                 seq_lens: torch.Tensor | None = None) -> torch.Tensor | None:
        """Logits [B, vocab] of one decode step replayed from its bucket's graph (a copy: the
        caller owns it), or None where no captured graph covers the step (see the module)."""
        size = None
        if pool is self.pool and self.device.type == "cuda":
            size = self.covers(*block_tables.shape)
        captured = self._captured.get(size) if size is not None else None
        if size is None or captured is None:
            self.num_eager += 1
            return None
        self._copy_in(self._static[size], token_ids, positions, slot_mapping, block_tables,
                      positions + 1 if seq_lens is None else seq_lens)
        captured.graph.replay()
        self.num_replays += 1
        return captured.logits[:token_ids.shape[0]].clone()

    def release(self) -> None:
        """Drop the graphs and give the scratch block back; the model decodes eagerly."""
        if self.model.graphs is self:
            self.model.graphs = None
        self._captured.clear()
        if self.scratch_block is not None:
            self.pool.allocator.free([self.scratch_block])
            self.pool.num_internal_blocks -= 1
            self.scratch_block = None


def capture_decode(model: Transformer, pool: KvPool, buckets: Sequence[int]
                   ) -> CudaGraphDecode | None:
    """Capture `model`'s decode step over `pool` for every bucket now (before the worker
    serves) and make its decode steps replay them. None, and decode stays as it was, where
    graphs do not apply: a device other than CUDA, or an attention backend other than
    Triton."""
    if model.device.type != "cuda":
        return None
    if model.backend.name != "triton":
        log.warning("cuda graphs: the %s attention backend cannot be captured (it reads "
                    "context lengths on the host); the decode step runs without graphs",
                    model.backend.name)
        return None
    graphs = CudaGraphDecode(model, pool, buckets)
    graphs.capture_all()
    model.graphs = graphs
    return graphs
