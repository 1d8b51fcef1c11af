"""The `priced` policy: the prefix policy's choice with every cached source priced in
seconds, from figures the workers measure.

For a prompt of `P` tokens in blocks of `bs` tokens, `K = max_shared_blocks(P, bs)` blocks a
cache may hold, `B` bytes per block, and per worker `w` the leading blocks it holds, each at
its fastest tier (`Worker.leading_tiers`: device, host, disk, store, the store's blocks any
worker wrote included; `H(w)` of them):

    fetch_s(w)   = sum over those blocks not on the device:
                   min(B / read_rate(w, tier), bs * s_tok(w))
    miss_s(w)    = s_tok(w) * (P - bs * H(w))
    prefill_cost = s_tok(p) * pending_tokens(p) + fetch_s(p) + alpha * miss_s(p)
    ship_s(d)    = (K - H(d)) * B / link(d)
    decode_cost  = fetch_s(d) + ship_s(d)
                   + (B / link(d)) / beta * (load_weight * used_blocks(d)
                                             + demand_weight * recent_demand(d))

A device hit is free; a block in a lower tier costs its bytes at the rate promotions from
that tier ran there (`TierStats`: bytes out over promotion seconds), never more than
recomputing it; a miss costs the worker's measured forward time per token
(`WorkerStats.prefill_s_per_token`); a decode worker's missing blocks cost their bytes over
the link the router measured pushing to it (`Worker.link_bytes_per_s`). The last term is
the prefix policy's load in blocks, converted to seconds at a block's transfer time over
`beta`. With `alpha = prefill_prefix_weight / load_weight`, `beta = prefix_weight` and no
lower-tier hits, both orders are the prefix policy's when the workers measure alike.

A figure that does not exist yet (no prefill measured, no push over 1 MiB to a decode
worker) leaves that choice to the prefix policy; a tier whose rate is not measured yet
counts as the device (the prefix policy's tier-agnostic credit). Headroom stays first in the
decode order, as there.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvferry.cache.prefix import Tier
from router.policies.routing import PrefixPolicy
from router.workers.worker import Worker


def _block_bytes(worker: Worker) -> int:
    layout = worker.layout
    return layout.num_layers * layout.bytes_per_layer_block if layout is not None else 0


def _ns(cost_s: float) -> int:
    """A cost to the nanosecond: costs equal but for float rounding tie, and the tie-breaks
    (requests in flight, address) decide, as they do for the prefix policy's equal costs."""
    return round(cost_s * 1e9)


class PricedPolicy(PrefixPolicy):
    name = "priced"

    @property
    def alpha(self) -> float:
        return self.prefill_prefix_weight / self.load_weight

    def fetch_s(self, worker: Worker, tiers: Sequence[Tier], s_tok: float) -> float:
        """Seconds to bring the worker's lower-tier hits into its pool."""
        block_bytes = _block_bytes(worker)
        recompute = worker.layout.block_size * s_tok if worker.layout is not None else 0.0
        total = 0.0
        for tier in tiers:
            rate = worker.tier_read_bytes_per_s(tier) if tier is not Tier.DEVICE else 0.0
            if rate > 0:
                total += min(block_bytes / rate, recompute)
        return total

    def priced_prefill(self, worker: Worker, prompt_tokens: int, keys: Sequence[bytes]
                       ) -> float:
        s_tok = worker.prefill_s_per_token
        tiers = worker.leading_tiers(keys)
        block_size = worker.layout.block_size if worker.layout is not None else 1
        miss_s = s_tok * (prompt_tokens - block_size * len(tiers))
        return (s_tok * worker.pending_tokens + self.fetch_s(worker, tiers, s_tok)
                + self.alpha * miss_s)

    def priced_decode(self, worker: Worker, keys: Sequence[bytes], s_tok: float) -> float:
        tiers = worker.leading_tiers(keys)
        block_s = _block_bytes(worker) / worker.link_bytes_per_s
        used = worker.total_blocks - worker.headroom
        return (self.fetch_s(worker, tiers, s_tok) + (len(keys) - len(tiers)) * block_s
                + block_s / self.prefix_weight
                * (self.load_weight * used + self.demand_weight * worker.demand.value()))

    def order_prefill(self, workers: list[Worker], prompt_tokens: int,
                      keys: Sequence[bytes] = ()) -> list[Worker]:
        if any(w.prefill_s_per_token <= 0 or w.layout is None for w in workers):
            return super().order_prefill(workers, prompt_tokens, keys)
        return sorted(workers, key=lambda w: (_ns(self.priced_prefill(w, prompt_tokens, keys)),
                                              w.num_in_flight, w.address))

    def order_decode(self, workers: list[Worker], need_blocks: int,
                     keys: Sequence[bytes] = ()) -> list[Worker]:
        # A decode worker prefills only short suffixes; the cap on a fetch is priced at the
        # slowest recompute any worker measured.
        s_tok = max((w.prefill_s_per_token for w in workers), default=0.0)
        if any(w.link_bytes_per_s <= 0 or w.layout is None for w in workers):
            return super().order_decode(workers, need_blocks, keys)
        return sorted(workers, key=lambda w: (w.headroom < need_blocks,
                                              _ns(self.priced_decode(w, keys, s_tok)),
                                              w.num_in_flight, w.address))
