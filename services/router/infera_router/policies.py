"""The policy registry: ``--router-policy NAME`` -> a fresh policy object.

Adding a policy = one new ``policy_<name>.py`` module with a class following
``infera_router.policy.Policy``, plus its line here.
"""

from __future__ import annotations

from collections.abc import Callable

from infera_router.policy import Policy
from infera_router.policy_least_loaded import LeastLoaded
from infera_router.policy_round_robin import RoundRobin

POLICIES: dict[str, Callable[[], Policy]] = {
    RoundRobin.name: RoundRobin,
    LeastLoaded.name: LeastLoaded,
}

POLICY_NAMES: tuple[str, ...] = tuple(POLICIES)


def create_policy(name: str) -> Policy:
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown router policy {name!r}; choose one of {', '.join(POLICY_NAMES)}") from None
    return factory()
