"""Protobuf <-> internal conversions shared by the servers (the only users of *_pb2)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from kvferry.cache.layout import KvLayout
from kvferry.cache.prefix import CacheEvent, EventsSince, Tier
from kvferry.cache.stats import PoolStats, TierState, TierStats
from kvferry.model.grammar import Constraint
from kvferry.model.logprobs import TokenLogprob
from kvferry.model.sampling import DEFAULT_MAX_TOKENS, SamplingParams
from kvferry.settings.sampling import KVFERRY_DEFAULTS, SamplingDefaults
from kvferry.v1 import generation_pb2, worker_pb2


def sampling_from_proto(msg: generation_pb2.SamplingParams,
                        default_max_tokens: int = DEFAULT_MAX_TOKENS,
                        defaults: SamplingDefaults = KVFERRY_DEFAULTS) -> SamplingParams:
    """Unset optional fields take their defaults (the model's, kvferry/model/
    sampling_defaults.py); validation is the caller's job."""
    return SamplingParams(
        temperature=msg.temperature if msg.HasField("temperature") else defaults.temperature,
        top_p=msg.top_p if msg.HasField("top_p") else defaults.top_p,
        top_k=msg.top_k if msg.HasField("top_k") else defaults.top_k,
        seed=msg.seed if msg.HasField("seed") else None,
        max_tokens=msg.max_tokens if msg.HasField("max_tokens") else default_max_tokens,
        stop=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        n=msg.n if msg.HasField("n") and msg.n != 0 else 1,
        kv_eviction=msg.kv_eviction,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
        presence_penalty=msg.presence_penalty, frequency_penalty=msg.frequency_penalty,
        repetition_penalty=(msg.repetition_penalty if msg.HasField("repetition_penalty")
                            else 1.0),
        logit_bias=tuple(sorted(msg.logit_bias.items())),
        constraint=constraint_from_proto(msg.constraint) if msg.HasField("constraint") else None,
    )


def constraint_from_proto(msg: generation_pb2.Constraint) -> Constraint | None:
    """None for a Constraint with no kind set, or json_object false."""
    kind = msg.WhichOneof("kind")
    if kind is None or (kind == "json_object" and not msg.json_object):
        return None
    if kind == "choice":
        return Constraint("choice", choices=tuple(msg.choice.values))
    return Constraint(kind, "" if kind == "json_object" else getattr(msg, kind))


def constraint_to_proto(constraint: Constraint) -> generation_pb2.Constraint:
    if constraint.kind == "choice":
        return generation_pb2.Constraint(
            choice=generation_pb2.Choices(values=list(constraint.choices)))
    if constraint.kind == "json_object":
        return generation_pb2.Constraint(json_object=True)
    return generation_pb2.Constraint(**{constraint.kind: constraint.spec})


def sampling_to_proto(params: SamplingParams) -> generation_pb2.SamplingParams:
    msg = generation_pb2.SamplingParams(
        temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
        max_tokens=params.max_tokens, stop=list(params.stop),
        stop_token_ids=list(params.stop_token_ids), ignore_eos=params.ignore_eos,
        kv_eviction=params.kv_eviction, presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty, logit_bias=dict(params.logit_bias),
    )
    if params.repetition_penalty != 1.0:
        msg.repetition_penalty = params.repetition_penalty
    if params.seed is not None:
        msg.seed = params.seed
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    if params.prompt_logprobs is not None:
        msg.prompt_logprobs = params.prompt_logprobs
    if params.constraint is not None:
        msg.constraint.CopyFrom(constraint_to_proto(params.constraint))
    return msg


def logprobs_to_proto(logprobs: Iterable[TokenLogprob]) -> list[generation_pb2.TokenLogprob]:
    return [generation_pb2.TokenLogprob(logprob=lp.logprob,
                                        top_token_ids=[i for i, _ in lp.top],
                                        top_logprobs=[v for _, v in lp.top])
            for lp in logprobs]


def logprobs_from_proto(msgs: Iterable[generation_pb2.TokenLogprob]
                        ) -> tuple[TokenLogprob, ...]:
    return tuple(TokenLogprob(m.logprob, tuple(zip(m.top_token_ids, m.top_logprobs)))
                 for m in msgs)


def stats_to_proto(role: str, stats: PoolStats, layout: worker_pb2.KvLayout
                   ) -> worker_pb2.WorkerStats:
    return worker_pb2.WorkerStats(
        role=role, total_blocks=stats.total_blocks, free_blocks=stats.free_blocks,
        reserved_blocks=stats.reserved_blocks, num_running=stats.num_running,
        num_waiting=stats.num_waiting, layout=layout, integrity_ok=stats.integrity_ok,
        integrity_error=stats.integrity_error, num_preemptions=stats.num_preemptions,
        num_pending_prefill_tokens=stats.num_pending_prefill_tokens,
        num_decode_steps=stats.num_decode_steps,
        max_abort_delay_steps=stats.max_abort_delay_steps,
        projected_blocks=stats.projected_blocks,
        num_corrupt_pushes=stats.num_corrupt_pushes,
        num_parked=stats.num_parked, num_parked_evictions=stats.num_evictions,
        num_compiles=stats.num_compiles, prefix_cache_queries=stats.prefix_cache_queries,
        prefix_cache_hits=stats.prefix_cache_hits, cached_blocks=stats.cached_blocks,
        prefill_s_per_token=stats.prefill_s_per_token,
        tensor_parallel_size=stats.tensor_parallel_size,
        kv_evicted_blocks=stats.kv_evicted_blocks,
        tiers=[worker_pb2.TierStats(**{**dataclasses.asdict(t), "tier": int(t.tier),
                                        "state": int(t.state)})
               for t in stats.tiers],
    )


def _tier_from_proto(msg: worker_pb2.TierStats) -> TierStats:
    values = {f.name: getattr(msg, f.name) for f in dataclasses.fields(TierStats)}
    return TierStats(**{**values, "tier": Tier(msg.tier), "state": TierState(msg.state)})


def add_cache_events(msg: worker_pb2.WorkerStats, events: EventsSince) -> None:
    msg.cache_event_seq = events.seq
    msg.cache_snapshot = events.is_snapshot
    msg.cache_events.extend(worker_pb2.CacheEvent(stored=e.stored, removed=e.removed,
                                                  tier=int(e.tier))
                            for e in events.events)


def layout_to_proto(layout: KvLayout) -> worker_pb2.KvLayout:
    return worker_pb2.KvLayout(
        num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim, block_size=layout.block_size, dtype=layout.dtype,
        model_fingerprint=layout.model_fingerprint,
    )


def layout_from_proto(msg: worker_pb2.KvLayout) -> KvLayout:
    return KvLayout(
        num_layers=msg.num_layers, num_kv_heads=msg.num_kv_heads, head_dim=msg.head_dim,
        block_size=msg.block_size, dtype=msg.dtype, model_fingerprint=msg.model_fingerprint,
    )


def stats_from_proto(msg: worker_pb2.WorkerStats) -> PoolStats:
    return PoolStats(
        total_blocks=msg.total_blocks, free_blocks=msg.free_blocks,
        reserved_blocks=msg.reserved_blocks, num_running=msg.num_running,
        num_waiting=msg.num_waiting, integrity_ok=msg.integrity_ok,
        integrity_error=msg.integrity_error, num_preemptions=msg.num_preemptions,
        num_pending_prefill_tokens=msg.num_pending_prefill_tokens,
        num_decode_steps=msg.num_decode_steps,
        max_abort_delay_steps=msg.max_abort_delay_steps,
        projected_blocks=msg.projected_blocks,
        num_corrupt_pushes=msg.num_corrupt_pushes,
        num_parked=msg.num_parked, num_evictions=msg.num_parked_evictions,
        num_compiles=msg.num_compiles, prefix_cache_queries=msg.prefix_cache_queries,
        prefix_cache_hits=msg.prefix_cache_hits, cached_blocks=msg.cached_blocks,
        tiers=tuple(_tier_from_proto(t) for t in msg.tiers),
        prefill_s_per_token=msg.prefill_s_per_token,
        tensor_parallel_size=msg.tensor_parallel_size or 1,  # 0: a worker from before
        kv_evicted_blocks=msg.kv_evicted_blocks,
        cache_events=EventsSince(
            msg.cache_event_seq,
            [CacheEvent(0, list(e.stored), list(e.removed), Tier(e.tier))
             for e in msg.cache_events],
            msg.cache_snapshot),
    )
