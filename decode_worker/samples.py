"""Parallel sampling on a decode worker: the n samples of one prompt share its K/V.

A request reserved with num_samples = n is sample 0: its reservation holds the prompt's
blocks, its first decode slot, and n - 1 spare blocks. Its Decode start brings the first
tokens of samples 1..n-1 (the prefill worker drew them from the prompt's last logits). When
it is admitted to the step loop, `fork_samples` makes samples 1..n-1: each shares the prompt's
full blocks (one more reference each) and gets a copy of the last partial block, if any, in
a block of its own (from the spares), so no step ever writes a block another sample reads.
From then on each sample is a sequence of its own in the step loop (its own tokens, growth,
speculation, preemption, finish), with the request's id, its `sample_index` and the
request's arrival (preemption treats the samples alike); its events carry its index.

Sample i samples with seed + i when the request has a seed, so it equals a request of its own
with that seed; the router checks seed + n fits in a seed.
"""

from __future__ import annotations

import dataclasses

from decode_worker.sequence import DecodeSeq, Phase
from kvferry.cache.block_table import fork
from kvferry.cache.pool import KvPool


def fork_samples(pool: KvPool, seq: DecodeSeq) -> list[DecodeSeq]:
    """Samples 1..n-1 of `seq` (sample 0, K/V complete, attached), each sharing the prompt's
    full blocks and holding a copy of its partial one; sets every sample's `group`. The spare
    blocks go back first, so the copies always find a block."""
    pool.allocator.free(seq.spare_blocks)
    seq.spare_blocks = []
    group = [seq]
    cached = seq.cache_position  # the prompt's tokens in the table (fewer if it evicted)
    full_tokens = cached // pool.block_size * pool.block_size
    assert seq.params is not None  # noqa: S101 - attached
    for index, first in enumerate(seq.sample_first_tokens, start=1):
        group.append(dataclasses.replace(
            seq, block_table=fork(pool, seq.block_table, cached),
            receipt=seq.receipt.copy(), params=seq.params.for_sample(index),
            guide=None if seq.guide is None else seq.guide.fresh(),
            tokens=[first], phase=Phase.RUNNING, sample_index=index, sample_first_tokens=[],
            num_draft_tokens=0, num_accepted_tokens=0, swapped_kv=None,
            # the shared full blocks keep sample 0's shipped draft pages; the copy does not
            draft_kv_tokens=min(seq.draft_kv_tokens, full_tokens)))
    seq.sample_first_tokens = []
    for member in group:
        member.group = group
    return group
