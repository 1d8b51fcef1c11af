"""The CUDA-graph decode step (kvferry.model.cuda_graphs). On CPU: buckets, the static
buffers and their padding (scratch block), every fallback to the eager step, and the graph's
body run uncaptured against the eager step, token for token. On a GPU (marker `gpu`):
capture, then replay against the eager step."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kvferry.cache.budget import blocks_for_tokens
from kvferry.cache.pool import KvPool
from kvferry.model.config import load_model_config
from kvferry.model.cuda_graphs import CudaGraphDecode, capture_decode, max_blocks_per_seq
from kvferry.model.transformer import Transformer
from kvferry_kernels.dispatch import get_attention_backend

BLOCK_SIZE = 16
BUCKETS = (1, 2, 4)
HAS_CUDA = torch.cuda.is_available()
IS_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _model(checkpoint: Path, backend: str = "torch", device: str = "cpu") -> Transformer:
    return Transformer(load_model_config(checkpoint), get_attention_backend(backend),
                       torch.float32, device)


def _pool(model: Transformer, num_blocks: int = 64) -> KvPool:
    cfg = model.config
    return KvPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, BLOCK_SIZE, num_blocks,
                  torch.float32, model.device)


def _inputs(tables: list[list[int]], positions: list[int]
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """token_ids, positions, slot_mapping, block_tables of one step, as decode takes them."""
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    slots = torch.tensor([t[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                          for t, p in zip(tables, positions)])
    tokens = torch.arange(7, 7 + len(tables))
    return tokens, torch.tensor(positions), slots, block_tables


@pytest.fixture
def tiny(qwen3_checkpoint: Path) -> tuple[Transformer, KvPool]:
    model = _model(qwen3_checkpoint)
    return model, _pool(model)


def test_buckets_and_width(tiny: tuple[Transformer, KvPool]) -> None:
    model, pool = tiny
    graphs = CudaGraphDecode(model, pool, (4, 1, 2, 2))
    assert graphs.buckets == BUCKETS
    assert [graphs.bucket(b) for b in (1, 2, 3, 4, 5)] == [1, 2, 4, 4, None]
    # max_position_embeddings 4096 is 256 blocks; the pool holds 64, one of them scratch.
    assert graphs.max_blocks == 63 == max_blocks_per_seq(4096, BLOCK_SIZE, 64)
    assert max_blocks_per_seq(100, BLOCK_SIZE, 64) == 7
    assert graphs.covers(3, 63) == 4 and graphs.covers(3, 64) is None
    assert graphs.covers(5, 1) is None
    assert graphs.static(4).block_tables.shape == (4, 63)
    with pytest.raises(ValueError, match="^cuda_graphs:"):
        max_blocks_per_seq(4096, BLOCK_SIZE, 1)
    with pytest.raises(ValueError, match="^cuda_graphs:"):
        CudaGraphDecode(model, pool, (0, 2))


def test_the_scratch_block_is_reserved_until_released(tiny: tuple[Transformer, KvPool]) -> None:
    model, pool = tiny
    graphs = CudaGraphDecode(model, pool, BUCKETS)
    scratch = graphs.scratch_block
    assert scratch is not None and pool.allocator.num_used == 1
    assert pool.num_usable_blocks == pool.num_blocks - 1  # what stats and admission count
    assert scratch not in pool.allocator.alloc(pool.allocator.num_free)  # never handed out
    assert graphs.scratch_slot == scratch * BLOCK_SIZE
    graphs.release()
    graphs.release()  # idempotent
    assert graphs.scratch_block is None and pool.allocator.num_free == 1
    assert pool.num_usable_blocks == pool.num_blocks
    assert pool.allocator.check_integrity().ok


def test_prepare_copies_real_rows_and_pads_the_rest(tiny: tuple[Transformer, KvPool]) -> None:
    model, pool = tiny
    pool.allocator.alloc(1)  # block 0, the value decode pads tables with, is not the scratch
    graphs = CudaGraphDecode(model, pool, BUCKETS)
    scratch = graphs.scratch_block
    assert scratch != 0
    tables = [pool.allocator.alloc(n) for n in (2, 1, 3)]
    positions = [20, 3, 40]
    tokens, pos, slots, block_tables = _inputs(tables, positions)
    assert graphs.prepare(tokens, pos, slots, block_tables) == 4
    s = graphs.static(4)
    assert s.token_ids.tolist() == tokens.tolist() + [0]
    assert s.positions.tolist() == positions + [0]
    assert s.seq_lens.tolist() == [21, 4, 41, 1]
    assert s.slot_mapping.tolist() == slots.tolist() + [graphs.scratch_slot]
    assert s.seq_lens.dtype == s.block_tables.dtype == torch.int32
    assert torch.equal(s.block_tables[:3, :3], block_tables)  # exactly as given, padding too
    assert (s.block_tables[:3, 3:] == scratch).all() and (s.block_tables[3] == scratch).all()

    # A full bucket of narrower tables, then three rows again: the fourth row becomes
    # padding once more and no column of the earlier, wider tables survives.
    assert graphs.prepare(*_inputs(tables[1:2] * 4, [5, 6, 7, 8])) == 4
    assert s.seq_lens.tolist() == [6, 7, 8, 9] and s.block_tables[3, 0] == tables[1][0]
    assert graphs.prepare(*_inputs(tables[1:2] * 3, [5, 6, 7])) == 4
    assert s.positions.tolist() == [5, 6, 7, 0] and s.token_ids[3] == 0
    assert s.seq_lens.tolist() == [6, 7, 8, 1]
    assert s.slot_mapping[3].item() == graphs.scratch_slot
    assert (s.block_tables[:3, 0] == tables[1][0]).all()
    assert (s.block_tables[:, 1:] == scratch).all() and s.block_tables[3, 0] == scratch


def test_steps_no_graph_covers_run_eagerly(tiny: tuple[Transformer, KvPool]) -> None:
    model, pool = tiny
    graphs = CudaGraphDecode(model, pool, BUCKETS, max_blocks=2)
    tables = [pool.allocator.alloc(3) for _ in range(5)]
    five = _inputs(tables, [33] * 5)
    assert graphs.prepare(*five) is None  # above every bucket
    assert graphs.prepare(*_inputs(tables[:1], [33])) is None  # 3 blocks > max_blocks 2
    assert graphs.prepare(*_inputs([tables[0][:2]], [20])) == 1
    # CPU: nothing captured and nothing replayed; so is a pool that is not the graphs' own.
    assert graphs(*_inputs([tables[0][:2]], [20]), pool) is None
    assert graphs(*_inputs([tables[0][:2]], [20]), _pool(model)) is None
    assert graphs.num_eager == 2 and graphs.num_replays == 0
    with pytest.raises(ValueError, match="^cuda_graphs: capture needs a CUDA device"):
        graphs.capture(1)


def test_capture_decode_applies_to_cuda_and_triton_only(tiny: tuple[Transformer, KvPool]
                                                        ) -> None:
    model, pool = tiny
    assert capture_decode(model, pool, BUCKETS) is None
    assert model.graphs is None and pool.allocator.num_used == 0
    on_cuda = SimpleNamespace(device=torch.device("cuda"), backend=get_attention_backend("torch"))
    assert capture_decode(on_cuda, pool, BUCKETS) is None  # type: ignore[arg-type]
    assert pool.allocator.num_used == 0


class _Stub:
    """A GraphStep that records its calls and answers `logits` (None: declines)."""

    def __init__(self, logits: torch.Tensor | None) -> None:
        self.logits = logits
        self.num_calls = 0

    def __call__(self, *args: object) -> torch.Tensor | None:
        self.num_calls += 1
        return self.logits


def test_decode_uses_the_graphs_unless_they_decline(tiny: tuple[Transformer, KvPool]) -> None:
    model, pool = tiny
    table = pool.allocator.alloc(1)
    step = _inputs([table], [0])
    eager = model.decode(*step, pool)
    model.graphs = _Stub(None)
    assert torch.equal(model.decode(*step, pool), eager) and model.graphs.num_calls == 1
    canned = torch.full_like(eager, 3.0)
    model.graphs = _Stub(canned)
    assert model.decode(*step, pool) is canned


def _prefill(model: Transformer, pool: KvPool, prompts: list[list[int]], steps: int
             ) -> tuple[list[list[int]], list[int]]:
    """Block tables (room for `steps` more tokens) and first tokens of `prompts`."""
    tables, first = [], []
    for prompt in prompts:
        table = pool.allocator.alloc(blocks_for_tokens(len(prompt) + steps + 1, BLOCK_SIZE))
        logits = model.prefill(torch.tensor(prompt, device=model.device), [len(prompt)],
                               pool.slots(table, 0, len(prompt)).to(model.device), pool)
        tables.append(table[::-1])  # blocks out of order, as a busy pool hands them out
        first.append(int(logits[0].argmax()))
    return tables, first


def _greedy(model: Transformer, pool: KvPool, tables: list[list[int]], prompt_lens: list[int],
            first: list[int], steps: int, graphs: CudaGraphDecode | None, is_replay: bool
            ) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy tokens and logits of `steps` decode steps: eager (graphs None), the graph's
    body run uncaptured on the static buffers, or (is_replay) decode with graphs hooked."""
    tokens = [[t] for t in first]
    all_logits = []
    model.graphs = graphs if is_replay else None
    for _ in range(steps):
        positions = [n + len(t) - 1 for n, t in zip(prompt_lens, tokens)]
        _, pos, slots, block_tables = _inputs(tables, positions)
        step = [x.to(model.device) for x in (torch.tensor([t[-1] for t in tokens]), pos,
                                            slots, block_tables)]
        if graphs is None or is_replay:
            logits = model.decode(*step, pool)
        else:
            size = graphs.prepare(*step)
            assert size is not None
            logits = graphs.run_body(size)[:len(tables)]
        all_logits.append(logits.cpu())
        for row, t in enumerate(tokens):
            t.append(int(logits[row].argmax()))
    model.graphs = None
    return tokens, all_logits


PROMPTS = [list(range(10, 27)), [5, 9, 200], list(range(40, 71))]
STEPS = 6


def _check_body_matches_eager(model: Transformer, steps: int) -> CudaGraphDecode:
    """Three rows padded to bucket 4: the body's tokens and logits are the eager step's."""
    pool = _pool(model)
    graphs = CudaGraphDecode(model, pool, (4,))
    tables, first = _prefill(model, pool, PROMPTS, steps)
    start = pool.cache.clone()
    lens = [len(p) for p in PROMPTS]
    eager, eager_logits = _greedy(model, pool, tables, lens, first, steps, None, False)
    after_eager = pool.cache.clone()
    pool.cache.copy_(start)
    body, body_logits = _greedy(model, pool, tables, lens, first, steps, graphs, False)
    assert body == eager
    for got, want in zip(body_logits, eager_logits):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # The padded row wrote its K/V to the scratch block only: everything else is as the
    # eager steps left it.
    others = [b for b in range(pool.num_blocks) if b != graphs.scratch_block]
    torch.testing.assert_close(pool.cache[:, :, others], after_eager[:, :, others],
                               atol=1e-5, rtol=1e-5)
    assert pool.cache[:, :, graphs.scratch_block].abs().sum() > 0
    return graphs


def test_the_graph_body_matches_the_eager_step(qwen3_checkpoint: Path) -> None:
    graphs = _check_body_matches_eager(_model(qwen3_checkpoint), STEPS)
    assert graphs.static(4).workspace is None  # the torch backend needs none


@pytest.mark.triton
@pytest.mark.skipif(not IS_INTERPRETED, reason="needs TRITON_INTERPRET=1 (CPU)")
def test_the_graph_body_matches_the_eager_step_with_triton_buffers(qwen3_checkpoint: Path
                                                                   ) -> None:
    """Triton attention with the fixed workspace and output, in the interpreter."""
    graphs = _check_body_matches_eager(_model(qwen3_checkpoint, "triton"), 2)
    workspace = graphs.static(4).workspace
    assert workspace is not None and workspace.partial_max.shape == (4, 4, 2)  # 2 splits


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or IS_INTERPRETED, reason="needs CUDA, native Triton")
def test_replay_matches_the_eager_step(qwen3_checkpoint: Path) -> None:
    model = _model(qwen3_checkpoint, "triton", "cuda")
    pool = _pool(model)
    graphs = capture_decode(model, pool, BUCKETS)
    assert graphs is not None and graphs.captured_sizes == BUCKETS and model.graphs is graphs
    model.graphs = None
    for rows in ([0], [0, 1], [0, 1, 2]):  # buckets 1, 2 and 4 (3 rows padded)
        prompts = [PROMPTS[i] for i in rows]
        tables, first = _prefill(model, pool, prompts, STEPS)
        start = pool.cache.clone()
        lens = [len(p) for p in prompts]
        eager, eager_logits = _greedy(model, pool, tables, lens, first, STEPS, None, False)
        pool.cache.copy_(start)
        replays = graphs.num_replays
        got, got_logits = _greedy(model, pool, tables, lens, first, STEPS, graphs, True)
        assert graphs.num_replays == replays + STEPS
        assert got == eager
        for a, b in zip(got_logits, eager_logits):
            torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)
        for table in tables:
            pool.allocator.free(table)
    # Five rows: above every bucket, so the step runs eagerly.
    tables = [pool.allocator.alloc(1) for _ in range(5)]
    model.graphs = graphs
    model.decode(*[x.cuda() for x in _inputs(tables, [1] * 5)], pool)
    assert graphs.num_eager == 1
    graphs.release()
    assert model.graphs is None


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or IS_INTERPRETED, reason="needs CUDA, native Triton")
def test_replay_equals_the_body_on_the_same_buffers(qwen3_checkpoint: Path) -> None:
    model = _model(qwen3_checkpoint, "triton", "cuda")
    pool = _pool(model)
    graphs = CudaGraphDecode(model, pool, (4,))
    graphs.capture_all()
    tables, first = _prefill(model, pool, PROMPTS, 1)
    positions = [len(p) for p in PROMPTS]
    _, pos, slots, block_tables = _inputs(tables, positions)
    step = [x.cuda() for x in (torch.tensor(first), pos, slots, block_tables)]
    start = pool.cache.clone()
    assert graphs.prepare(*step) == 4
    body = graphs.run_body(4)[:3].clone()
    pool.cache.copy_(start)
    model.graphs = graphs
    replayed = model.decode(*step, pool)
    torch.testing.assert_close(replayed, body, atol=1e-5, rtol=1e-5)


@pytest.mark.triton
@pytest.mark.skipif(not IS_INTERPRETED, reason="needs TRITON_INTERPRET=1 (CPU)")
def test_verification_rows_attend_as_runs(qwen3_checkpoint: Path) -> None:
    """A speculative step's rows (one sequence's last token and drafts) with `query_runs`:
    the backend gets run_rows once per step, the eager step and the graph body give the
    logits they give without it."""
    model = _model(qwen3_checkpoint, "triton")
    pool = _pool(model)
    graphs = CudaGraphDecode(model, pool, (8,))
    assert graphs.static(8).run_rows is None  # query_runs off: the kernel as before
    tables, _ = _prefill(model, pool, [PROMPTS[0], PROMPTS[2]], 8)
    a, b = len(PROMPTS[0]), len(PROMPTS[2])
    step = _inputs([tables[0]] * 5 + [tables[1]] * 2, [a, a + 1, a + 2, a + 3, a + 4, b, b + 1])
    want = model.decode(*step, pool)
    calls = []
    attention = model.backend.decode_attention

    def recording(*args: object, **kwargs: torch.Tensor) -> torch.Tensor:
        calls.append(kwargs.get("run_rows"))
        return attention(*args, **kwargs)

    model.backend = model.backend._replace(decode_attention=recording)
    model.query_runs = True
    got = model.decode(*step, pool)
    assert len(calls) == model.config.num_layers
    assert all(c is calls[0] for c in calls)  # computed once for the step
    assert calls[0].tolist() == [5, 0, 0, 0, 0, 2, 0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    graphs = CudaGraphDecode(model, pool, (8,))
    size = graphs.prepare(*step)
    assert graphs.static(8).run_rows.tolist() == [5, 0, 0, 0, 0, 2, 0, 1]  # row 8: padding
    torch.testing.assert_close(graphs.run_body(size)[:7], want, atol=1e-4, rtol=1e-4)
