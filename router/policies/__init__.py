"""Every routing policy by name (`--policy`, `kvferry.settings.POLICIES`), and building one."""

from __future__ import annotations

from kvferry.settings import (
    DEFAULT_DEMAND_WEIGHT,
    DEFAULT_LOAD_WEIGHT,
    DEFAULT_PREFILL_PREFIX_WEIGHT,
    DEFAULT_PREFIX_WEIGHT,
)
from kvferry.settings import POLICIES as POLICY_NAMES
from router.policies.priced import PricedPolicy
from router.policies.routing import (
    HeadroomPolicy,
    LeastRequestsPolicy,
    Policy,
    PrefixPolicy,
    RoundRobinPolicy,
)

# Keyed by kvferry.settings.POLICIES, the names flags and settings accept, in their order.
POLICIES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (PrefixPolicy, HeadroomPolicy, RoundRobinPolicy, LeastRequestsPolicy,
                PricedPolicy)}


def make_policy(name: str, prefix_weight: float = DEFAULT_PREFIX_WEIGHT,
                load_weight: float = DEFAULT_LOAD_WEIGHT,
                prefill_prefix_weight: float = DEFAULT_PREFILL_PREFIX_WEIGHT,
                demand_weight: float = DEFAULT_DEMAND_WEIGHT) -> Policy:
    """The policy called `name`; the weights are the prefix policy's (the others have none)."""
    if name not in POLICY_NAMES or name not in POLICIES:
        raise ValueError(f"policy: unknown {name!r}; one of {list(POLICY_NAMES)}")
    if name in (PrefixPolicy.name, PricedPolicy.name):
        return POLICIES[name](prefix_weight, load_weight,  # type: ignore[call-arg]
                              prefill_prefix_weight, demand_weight)
    return POLICIES[name]()
