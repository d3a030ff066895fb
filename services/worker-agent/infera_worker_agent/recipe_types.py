"""What every recipe rule takes and gives. A rule is a pure function ``rule(ctx) -> RuleResult``.

``ctx`` holds the engine's arguments as its parser reads them (the user's, in order, then what the
agent and the rules before it appended), the environment the engine would get, the facts about the
host (``host_probe``), whether KV events are on, the role read from the engine's flags
(``pd_role``) and the advertise host. A rule returns the arguments to append, the environment
variables to set (only ones that are unset) and notes saying what it did or skipped and why; it
refuses a launch that cannot work by raising ``RecipeRefusal`` with a message naming the problem
and the fix.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from infera_common.schemas import Role
from infera_worker_agent.engine_cmd import EngineArgsError
from infera_worker_agent.host_probe import HostFacts
from infera_worker_agent.pd_role import PdPlan

REAL_ENGINES = ("sglang", "vllm")  # the mock's KV transfer is always (simulated) TCP: no recipes
PD_ROLES = (Role.PREFILL, Role.DECODE)


class RecipeRefusal(EngineArgsError):
    """The launch cannot work as asked; the message names the problem and the fix."""


@dataclass(frozen=True, slots=True)
class RecipeContext:
    engine: str  # mock | sglang | vllm
    args: tuple[str, ...]  # as the engine's parser reads them (engine_cmd.vllm_flag_view for vLLM)
    env: Mapping[str, str]  # the environment the engine would get
    host: HostFacts
    kv_events: bool  # the engine will publish KV events (the agent's or the user's --kv-events-config)
    pd: PdPlan
    advertise_host: str
    allow_tcp: bool = False  # --disaggregation-allow-tcp

    @property
    def role(self) -> Role:
        return self.pd.role

    @property
    def pd_leg(self) -> bool:
        return self.engine in REAL_ENGINES and self.pd.role in PD_ROLES


@dataclass(frozen=True, slots=True)
class RuleResult:
    args: tuple[str, ...] = ()  # appended to the engine's command line
    env: tuple[tuple[str, str], ...] = ()  # set in the engine's environment (only unset variables)
    notes: tuple[str, ...] = ()  # what the rule did or skipped, and why


NOTHING = RuleResult()


def note(text: str) -> RuleResult:
    return RuleResult(notes=(text,))
