"""A model split over ranks (kvferry/model/tensor_parallel.py) computes what the whole model
does: each rank a process of its own, the ranks' sums over torch.distributed's gloo, each
rank's pool holding only its K/V heads. Greedy tokens equal the whole model's; logits agree
to the last bits the sums' order changes."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.model.config import load_model_config
from kvferry.model.tensor_parallel import Shard, check_tensor_parallel, transfer_plan
from kvferry.model.transformer import Transformer
from kvferry.rpc.grpc_util import free_port
from kvferry_kernels.dispatch import get_attention_backend
from tests.kvferry.model.greedy_split import greedy, pool_of


def _rank(rank: int, size: int, port: int, checkpoint: str, results: dict) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size)
    try:
        torch.set_num_threads(1)
        config = load_model_config(Path(checkpoint))
        model = Transformer(config, get_attention_backend("torch"),
                            shard=Shard.of(config, rank, size))
        model.all_reduce = dist.all_reduce
        pool = pool_of(model)
        tokens, logits = greedy(model, pool)
        results[rank] = (tokens, logits, pool.num_kv_heads)
    finally:
        dist.destroy_process_group()



@pytest.mark.parametrize("arch, size", [("qwen3", 2), ("qwen3", 4), ("llama", 2)])
def test_split_over_ranks_it_decodes_as_the_whole_model(
        arch: str, size: int, request: pytest.FixtureRequest) -> None:
    """qwen3 has 4 heads and 2 K/V heads: over 2 ranks each holds one K/V head, over 4 each
    K/V head is on two ranks; llama 6 and 2."""
    checkpoint = request.getfixturevalue(f"{arch}_checkpoint")
    config = load_model_config(checkpoint)
    whole = Transformer(config, get_attention_backend("torch"))
    expected, expected_logits = greedy(whole, pool_of(whole))
    results = mp.Manager().dict()
    mp.start_processes(_rank, args=(size, free_port(), str(checkpoint), results),
                       nprocs=size, start_method="spawn")
    for rank in range(size):
        tokens, logits, pool_kv_heads = results[rank]
        assert tokens == expected, rank
        torch.testing.assert_close(logits, expected_logits, atol=1e-4, rtol=1e-4)
        assert pool_kv_heads == max(config.num_kv_heads // size, 1)  # only its own


def test_each_rank_owns_its_heads_and_kv_heads_replicate_past_their_number(
        qwen3_checkpoint: Path) -> None:
    config = load_model_config(qwen3_checkpoint)  # 4 heads, 2 K/V heads
    two = [Shard.of(config, r, 2) for r in range(2)]
    assert [list(s.q_heads) for s in two] == [[0, 1], [2, 3]]
    assert [list(s.kv_heads) for s in two] == [[0], [1]]
    four = [Shard.of(config, r, 4) for r in range(4)]
    assert [list(s.q_heads) for s in four] == [[0], [1], [2], [3]]
    assert [list(s.kv_heads) for s in four] == [[0], [0], [1], [1]]  # each on two ranks
    for shard in four:  # a rank's query heads read the K/V heads it holds
        group = config.num_heads // config.num_kv_heads
        assert {h // group for h in shard.q_heads} == set(shard.kv_heads)


@pytest.mark.parametrize("size", [0, 3, 8])
def test_a_size_that_does_not_split_the_model_is_named(qwen3_checkpoint: Path,
                                                       size: int) -> None:
    """qwen3: 4 heads (3 and 8 do not divide them), 2 K/V heads, an MLP 512 wide."""
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        check_tensor_parallel(load_model_config(qwen3_checkpoint), size)


@st.composite
def _splits(draw: st.DrawFn) -> tuple[int, int, int, int]:
    """A model's K/V heads and query heads, and a prefill and a decode size that split it."""
    kv = draw(st.sampled_from([1, 2, 3, 4, 8]))
    heads = kv * draw(st.sampled_from([1, 2, 3, 4]))

    def size() -> int:
        fits = [n for n in range(1, 17) if heads % n == 0 and (kv % n == 0 or n % kv == 0)]
        return draw(st.sampled_from(fits))

    return heads, kv, size(), size()


@settings(max_examples=300, deadline=None)
@given(_splits())
def test_every_decode_rank_gets_exactly_its_kv_heads_from_ranks_holding_them(
        split: tuple[int, int, int, int]) -> None:
    """Whole K/V (one tensor a head) split as the prefill ranks hold it, moved as the plan
    says: each decode rank's pool comes out as the whole K/V split its way, no head sent
    twice to a rank, and with replicas the sends spread over them."""
    heads, kv, prefill_size, decode_size = split
    inter = 16 * heads
    whole = torch.arange(kv, dtype=torch.float32)[:, None] * 10 + torch.rand(kv, 3)

    def shards(size: int) -> list[Shard]:
        return [Shard(r, size, heads, kv, inter) for r in range(size)]

    prefill = [whole[list(s.kv_heads)] for s in shards(prefill_size)]
    decode = [torch.full((s.kv_heads_per_rank, 3), float("nan")) for s in shards(decode_size)]
    plan = transfer_plan(heads, kv, inter, prefill_size, decode_size)
    for send in plan:
        assert torch.isnan(decode[send.dst_rank][send.dst_index]).all()  # each slot once
        decode[send.dst_rank][send.dst_index] = prefill[send.src_rank][send.src_index]
    for shard, pool in zip(shards(decode_size), decode):
        assert torch.equal(pool, whole[list(shard.kv_heads)])
    load = Counter(s.src_rank for s in plan)
    replicas = max(prefill_size // kv, 1)
    if replicas > 1 and decode_size >= prefill_size:
        assert len(load) == prefill_size  # every replica sends a share
