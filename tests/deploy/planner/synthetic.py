"""A synthetic profile whose costs are known exactly, for the planner's tests."""

from __future__ import annotations

from deploy.planner.profile import CostModel, DecodePoint, PrefillPoint, Profile, TransferPoint

# prefill a + b * tokens + c * attention, decode base(batch) + k * context, transfer t0 + t1 * n
PREFILL = (0.002, 1e-4, 1e-8)
DECODE_BASE = {1: 0.005, 2: 0.006, 4: 0.008, 8: 0.012, 16: 0.020, 32: 0.036}
DECODE_PER_CONTEXT = 1e-7
TRANSFER = (0.001, 1e-6)


def turns(values: list[int]) -> int:
    """How often a sequence of worker counts changes direction."""
    moves = [b - a for a, b in zip(values, values[1:]) if b != a]
    return sum(1 for a, b in zip(moves, moves[1:]) if (a > 0) != (b > 0))


def make_profile(num_blocks: int = 10_000, jitter: tuple[float, ...] = (), **changes
                 ) -> Profile:
    a, b, c = PREFILL
    t0, t1 = TRANSFER
    fields = dict(
        model="synthetic", dtype="float32", device="cpu", kv_transport="grpc",
        torch_threads=1, block_size=16, kv_bytes_per_token=1000, num_blocks=num_blocks,
        prefill_token_budget=512, prefill_chunk_size=512, batch_buckets=(), max_model_len=8192,
        prefill=tuple(PrefillPoint(n, n * n, a + b * n + c * n * n)
                      for n in (16, 64, 256, 512)),
        decode=tuple(DecodePoint(batch, batch * ctx, base + DECODE_PER_CONTEXT * batch * ctx,
                                 jitter)
                     for batch, base in DECODE_BASE.items() for ctx in (64, 512)),
        transfer=tuple(TransferPoint(n, t0 + t1 * n) for n in (16, 256, 1024)))
    fields.update(changes)
    return Profile(**fields)


def make_cost(**changes) -> CostModel:
    return CostModel(make_profile(**changes))


# The shifting workload of the live-planner tests on a real deployment (4 workers at most):
# at SHIFT_RATES[0] requests/s of SHIFT_LENGTHS[0] (prompt, output) tokens only 1P+3D
# meets SHIFT_SLA, at SHIFT_RATES[1] of SHIFT_LENGTHS[1] only 3P+1D; the costs say so
# whatever machine runs the deployment, and the rates are ones a tiny model serves on 2 cores.
SHIFT_SLA = "ttft-p90=500,itl-p90=20"
SHIFT_LENGTHS = ((20, 48), (300, 4))
SHIFT_RATES = (3.5, 3.0)


def shifting_profile() -> Profile:
    """prefill 2 ms + 1.2 ms a token; decode 4 ms + 7 ms a sequence."""
    return make_profile(
        prefill=tuple(PrefillPoint(n, n * n, 0.002 + 1.2e-3 * n) for n in (16, 64, 256, 512)),
        decode=tuple(DecodePoint(batch, batch * ctx, 0.004 + 0.007 * batch)
                     for batch in DECODE_BASE for ctx in (64, 512)))
