"""The policy registry: ``--router-policy NAME`` -> a fresh policy object.

Adding a policy = one new ``policy_<name>.py`` module with a class following
``infera_router.policy.Policy``, plus its line here.
"""

from __future__ import annotations

from collections.abc import Callable

from infera_router.policy import Policy
from infera_router.policy_kv_aware import DEFAULT_DECODE_WEIGHT, DEFAULT_EVICT_WEIGHT, DEFAULT_OVERLAP_WEIGHT, KvAware
from infera_router.policy_least_loaded import LeastLoaded
from infera_router.policy_round_robin import RoundRobin

POLICIES: dict[str, Callable[..., Policy]] = {
    KvAware.name: lambda kv_overlap_weight=DEFAULT_OVERLAP_WEIGHT, kv_decode_weight=DEFAULT_DECODE_WEIGHT,
    kv_evict_weight=DEFAULT_EVICT_WEIGHT: KvAware(
        kv_overlap_weight, decode_weight=kv_decode_weight, evict_weight=kv_evict_weight),
    RoundRobin.name: lambda **_: RoundRobin(),
    LeastLoaded.name: lambda **_: LeastLoaded(),
}

POLICY_NAMES: tuple[str, ...] = tuple(POLICIES)
DEFAULT_POLICY = KvAware.name


def create_policy(name: str, kv_overlap_weight: float = DEFAULT_OVERLAP_WEIGHT,
                  kv_decode_weight: float = DEFAULT_DECODE_WEIGHT,
                  kv_evict_weight: float = DEFAULT_EVICT_WEIGHT) -> Policy:
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown router policy {name!r}; choose one of {', '.join(POLICY_NAMES)}") from None
    return factory(kv_overlap_weight=kv_overlap_weight, kv_decode_weight=kv_decode_weight,
                   kv_evict_weight=kv_evict_weight)
