"""A mistyped INFERA_* variable stops the program at start with the name it meant, where
pydantic-settings alone ignored it (a router on its default policy, a frontend on its default
timeout); variables of the fleet's other programs are left alone."""

from __future__ import annotations

import itertools
import subprocess
import sys

import pytest

from infera.server_settings import ServerSettings
from infera.tools.preflight.settings import PreflightSettings
from infera.up import UpSettings
from infera_common.settings import ENV_PREFIX, env_names, parse_cli
from infera_common.typos import CUTOFF, env_near_misses
from infera_frontend.settings import FrontendSettings
from infera_kv_indexer.settings import KvIndexerSettings
from infera_router.settings import RouterSettings
from infera_worker_agent.settings import AgentSettings

PROGRAMS = (FrontendSettings, RouterSettings, KvIndexerSettings, AgentSettings, ServerSettings, UpSettings,
            PreflightSettings)
KNOWN = frozenset({"INFERA_ROUTER_POLICY", "INFERA_DRAIN_TIMEOUT", "INFERA_PORT"})


def test_a_near_name_is_refused_with_the_name_meant_case_ignored():
    environ = ["INFERA_ROUTER_POLCY", "infera_drain_timeot", "PATH", "INFERA_PORT"]
    assert env_near_misses(environ, KNOWN, ENV_PREFIX, "svc") == [
        "environment variable INFERA_ROUTER_POLCY is not a setting of svc, and would be ignored: "
        "did you mean INFERA_ROUTER_POLICY?",
        "environment variable infera_drain_timeot is not a setting of svc, and would be ignored: "
        "did you mean INFERA_DRAIN_TIMEOUT?",
    ]


def test_one_slip_in_a_short_name_is_refused_and_two_are_not():
    known = frozenset({"INFERA_PORT", "INFERA_ROLE", "INFERA_HOST", "INFERA_WORKERS", "INFERA_NATS_URL"})
    environ = ["INFERA_PROT", "INFERA_ROEL", "INFERA_ROL", "INFERA_PORTS", "INFERA_WORKRES", "INFERA_NATS_ULR",
               "INFERA_HOME", "INFERA_PTRO", "INFERA_RL"]
    meant = [m.rsplit(" ", 1)[-1] for m in env_near_misses(environ, known, ENV_PREFIX, "svc")]
    assert meant == ["INFERA_PORT?", "INFERA_ROLE?", "INFERA_ROLE?", "INFERA_PORT?", "INFERA_WORKERS?",
                     "INFERA_NATS_URL?"]


def test_names_far_from_every_setting_and_other_prefixes_are_left_alone():
    environ = ["INFERA_KV_EVENTS_STREAM_X", "INFERA_SOMETHING_ELSE", "ROUTER_POLICY", "XINFERA_ROUTER_POLICY",
               "infera_port"]
    assert env_near_misses(environ, KNOWN, ENV_PREFIX, "svc") == []


def test_env_names_hold_every_field_and_the_frontends_aliases_under_the_prefix():
    names = env_names(FrontendSettings)
    assert {"INFERA_MODEL_PATH", "INFERA_ROUTER_TOKENIZER_PATH", "INFERA_NATS_URL", "INFERA_PORT"} <= names
    assert "INFERA_PREFLIGHT_DUMP_PATH" in env_names(PreflightSettings)


def test_no_programs_variable_looks_like_a_mistyped_one_of_another_program():
    """What makes the refusal safe in a shared environment (compose, `infera up`): a variable meant
    for one Infera program is never refused by another as a near miss of its own."""
    clashes = []
    for mine, theirs in itertools.permutations(PROGRAMS, 2):
        own = env_names(mine)
        clashes += env_near_misses(env_names(theirs) - own, own, mine.model_config.get("env_prefix", ENV_PREFIX),
                                   mine.__name__)
    assert clashes == [], f"within {CUTOFF} of another program's variable: {clashes}"


def test_parse_cli_exits_2_naming_the_variable(monkeypatch, capsys):
    monkeypatch.setenv("INFERA_KV_OVERLAP_WEIGTH", "4")
    with pytest.raises(SystemExit) as exit_:
        parse_cli(RouterSettings, [], prog="infera-router")
    assert exit_.value.code == 2
    assert "INFERA_KV_OVERLAP_WEIGTH is not a setting of infera-router" in capsys.readouterr().err
    parse_cli(FrontendSettings, [], prog="infera-frontend")  # not the frontend's: left to the router


def test_infera_up_refuses_a_mistyped_variable_of_a_service_it_starts_before_starting_anything(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "INFERA_HEALTH_TIMEOT": "1800"}
    done = subprocess.run([sys.executable, "-m", "infera.cli", "up", "--state-dir", str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert ("INFERA_HEALTH_TIMEOT is not a setting of infera up or the services it starts, and would be "
            "ignored: did you mean INFERA_HEALTH_TIMEOUT?") in done.stderr
    assert not any(tmp_path.iterdir())  # nothing was started
