"""Tensor parallelism: one worker's model split over N ranks, as Megatron-LM splits a decoder
and vLLM serves it.

- Attention: each rank computes its share of the query heads, with the K/V heads those read.
  qkv_proj is column-parallel (its output rows for those heads) and o_proj row-parallel (its
  input columns for them). The ranks' o_proj outputs are summed (all-reduce).
- When N exceeds the K/V heads, each K/V head is replicated on N / num_kv_heads ranks, as
  vLLM does. Each rank's K/V pool holds only its own K/V heads.
- MLP: gate_up_proj column-parallel, down_proj row-parallel, summed.
- Embeddings, norms and the LM head are whole on every rank.
- A row-parallel bias is added once: rank 0 keeps it, the others drop it.

`Shard` says which heads a rank owns, and `shard_config` and `shard_weights` give the rank's
model. The all-reduce is the caller's: torch.distributed (gloo on CPU, NCCL on CUDA), or a
plain sum in tests.

Between a prefill worker split P ways and a decode worker split D ways, `transfer_plan` says
which prefill rank sends each decode rank each K/V head it owns: every decode rank gets
exactly its heads, each once, from a rank that holds it (with replicas, the one whose
position among the replicas matches, so the sends spread over them).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kvferry.model.config import ModelConfig


@dataclass(frozen=True)
class Shard:
    """Rank `rank` of `size`, for a model of `num_heads` query heads, `num_kv_heads` K/V
    heads and an MLP `intermediate_size` wide."""

    rank: int
    size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int

    @staticmethod
    def of(config: ModelConfig, rank: int, size: int) -> Shard:
        check_tensor_parallel(config, size)
        if not 0 <= rank < size:
            raise ValueError(f"rank: must be in [0, {size}), got {rank}")
        return Shard(rank, size, config.num_heads, config.num_kv_heads,
                     config.intermediate_size)

    @property
    def heads_per_rank(self) -> int:
        return self.num_heads // self.size

    @property
    def kv_heads_per_rank(self) -> int:
        return kv_heads_per_rank(self.num_kv_heads, self.size)

    @property
    def replicas(self) -> int:
        """Ranks holding each K/V head (1 unless the ranks outnumber the K/V heads)."""
        return max(self.size // self.num_kv_heads, 1)

    @property
    def q_heads(self) -> range:
        return range(self.rank * self.heads_per_rank, (self.rank + 1) * self.heads_per_rank)

    @property
    def kv_heads(self) -> range:
        """The K/V heads this rank's query heads read, which its pool holds."""
        first = (self.rank // self.replicas) * self.kv_heads_per_rank
        return range(first, first + self.kv_heads_per_rank)

    @property
    def mlp_columns(self) -> range:
        width = self.intermediate_size // self.size
        return range(self.rank * width, (self.rank + 1) * width)


@dataclass(frozen=True)
class HeadSend:
    """One K/V head moved: prefill rank `src_rank` sends its pool's head `src_index` (its
    position among the rank's K/V heads) into decode rank `dst_rank`'s `dst_index`; `head`
    is the head's number in the whole model."""

    head: int
    src_rank: int
    src_index: int
    dst_rank: int
    dst_index: int


def transfer_plan(num_heads: int, num_kv_heads: int, intermediate_size: int,
                  prefill_size: int, decode_size: int) -> list[HeadSend]:
    """Every K/V head each decode rank owns, from a prefill rank that holds it, in order of
    decode rank then head."""
    def shards(size: int) -> list[Shard]:
        return [Shard(r, size, num_heads, num_kv_heads, intermediate_size) for r in range(size)]

    prefill, sends = shards(prefill_size), []
    for dst in shards(decode_size):
        for dst_index, head in enumerate(dst.kv_heads):
            holders = [s for s in prefill if head in s.kv_heads]
            src = holders[dst.rank % len(holders)]
            sends.append(HeadSend(head, src.rank, src.kv_heads.index(head), dst.rank,
                                  dst_index))
    return sends


def splits_kv_heads(num_kv_heads: int, size: int) -> bool:
    """Whether `size` ranks can hold `num_kv_heads` K/V heads: it divides them, or is a
    multiple of them (each head then replicated)."""
    return not (num_kv_heads % size and size % num_kv_heads)


def kv_heads_per_rank(num_kv_heads: int, size: int) -> int:
    """K/V heads each of `size` ranks holds (one where they are replicated)."""
    return max(num_kv_heads // size, 1)


def check_tensor_parallel(config: ModelConfig, size: int) -> None:
    """ValueError naming tensor_parallel_size unless `size` ranks can split this model: it
    divides the query heads and the MLP, and divides the K/V heads or is a multiple of them."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size: must be >= 1, got {size}")
    kv = config.num_kv_heads
    if (config.num_heads % size or config.intermediate_size % size
            or not splits_kv_heads(kv, size)):
        raise ValueError(
            f"tensor_parallel_size: {size} does not split this model: it must divide its "
            f"{config.num_heads} attention heads and its MLP width {config.intermediate_size}, "
            f"and divide its {kv} K/V heads or be a multiple of them")


def shard_config(config: ModelConfig, shard: Shard) -> ModelConfig:
    """The rank's model shape: its heads and its MLP columns (the rest is whole)."""
    return dataclasses.replace(config, num_heads=shard.heads_per_rank,
                               num_kv_heads=shard.kv_heads_per_rank,
                               intermediate_size=len(shard.mlp_columns))


def _rows(tensor: torch.Tensor, heads: range, head_dim: int) -> torch.Tensor:
    return tensor[heads.start * head_dim:heads.stop * head_dim]


def shard_weights(weights: dict[str, torch.Tensor], config: ModelConfig, shard: Shard
                  ) -> dict[str, torch.Tensor]:
    """The rank's weights, from the whole model's (fused as kvferry.model.weights loads them:
    qkv_proj rows are q, then k, then v; gate_up_proj rows are gate, then up). Slices are
    copied, so the whole model's tensors can be freed."""
    if shard.size == 1:
        return weights
    d = config.head_dim
    q_size, kv_size = config.num_heads * d, config.num_kv_heads * d
    inter = config.intermediate_size
    cols = shard.mlp_columns
    out: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        if ".self_attn.qkv_proj." in name:
            q, k, v = tensor.split([q_size, kv_size, kv_size])
            part = torch.cat([_rows(q, shard.q_heads, d), _rows(k, shard.kv_heads, d),
                              _rows(v, shard.kv_heads, d)])
        elif name.endswith(".self_attn.o_proj.weight"):
            heads = shard.q_heads
            part = tensor[:, heads.start * d:heads.stop * d]
        elif ".mlp.gate_up_proj." in name:
            gate, up = tensor[:inter], tensor[inter:]
            part = torch.cat([gate[cols.start:cols.stop], up[cols.start:cols.stop]])
        elif name.endswith(".mlp.down_proj.weight"):
            part = tensor[:, cols.start:cols.stop]
        elif name.endswith((".self_attn.o_proj.bias", ".mlp.down_proj.bias")):
            if shard.rank:
                continue  # added once, after the sum
            part = tensor
        else:
            out[name] = tensor  # whole on every rank
            continue
        out[name] = part.contiguous().clone()
    return out
