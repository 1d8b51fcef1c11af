"""Runs of rows: several query positions of one sequence in one decode batch.

A speculative step attends a sequence's last token and its k drafts as k + 1 consecutive rows
with the same block table and lengths one apart (`decode_worker/spec/drafting.py`, the K/V of
all of them written before attention). A run's rows read the same K/V, so every kernel reads
it once for all of them: the C kernel (`cpu_decode_attention.c`, `run_of_rows`), the torch
path (`paged_attention_torch`) and Triton (`triton_paged_attention`, given `run_rows`).

The grouping is found from the inputs alone, never trusted from the caller: row b continues
row b - 1's run when its length is one more and its whole block table row is the same.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


def joined_rows(block_table: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """[B] bool: row b continues row b - 1's run (row 0 never does). No host sync."""
    joined = torch.zeros(seq_lens.shape[0], dtype=torch.bool, device=seq_lens.device)
    if seq_lens.shape[0] > 1:
        joined[1:] = (((seq_lens[1:] - seq_lens[:-1]) == 1)
                      & (block_table[1:] == block_table[:-1]).all(1))
    return joined


class QueryRuns(NamedTuple):
    """Each row's run and place in it."""

    run: torch.Tensor  # [B] int64: the run each row belongs to, 0 .. num_runs - 1
    offset: torch.Tensor  # [B] int64: the row's place in its run (its length - the first's)
    first: torch.Tensor  # [num_runs] int64: each run's first row
    last: torch.Tensor  # [num_runs] int64: each run's last row (its longest length)
    longest: int  # rows of the longest run (1: every row alone)


def _offsets(joined: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's run index and place in its run. No host sync."""
    rows = torch.arange(joined.shape[0], device=joined.device)
    starts = torch.where(joined, 0, rows).cummax(0).values  # each row's run's first row
    return (~joined).cumsum(0) - 1, rows - starts


def query_runs(block_table: torch.Tensor, seq_lens: torch.Tensor) -> QueryRuns:
    """The rows' runs, uncapped (reads the longest back to the host)."""
    joined = joined_rows(block_table, seq_lens)
    run, offset = _offsets(joined)
    rows = torch.arange(joined.shape[0], device=joined.device)
    first = rows[~joined]
    last = torch.cat([first[1:] - 1, rows[-1:]])
    return QueryRuns(run, offset, first, last, int(offset.max()) + 1 if len(rows) else 1)


def run_rows(block_table: torch.Tensor, seq_lens: torch.Tensor, most: int) -> torch.Tensor:
    """[B] int32: how many rows, from row b on, row b's program attends, runs cut into
    pieces of at most `most` rows; 0 for a row a program before it attends. No host sync
    (a CUDA graph may capture it)."""
    joined = joined_rows(block_table, seq_lens)
    run, offset = _offsets(joined)
    size = torch.zeros_like(offset).scatter_reduce(0, run, offset + 1, "amax")[run]
    leads = (offset % most) == 0
    return torch.where(leads, torch.clamp(size - offset, max=most), 0).to(torch.int32)


__all__ = ["QueryRuns", "joined_rows", "query_runs", "run_rows"]
