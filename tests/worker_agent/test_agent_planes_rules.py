"""The agent's plane rules without processes: which mixes need NATS, which are refused before
anything starts, what the record advertises, and when an HTTP-plane drain counts as done."""

from __future__ import annotations

import itertools

import pytest

from infera_worker_agent.engine_drain import IdleCheck, wait_engine_idle
from infera_worker_agent.kv_config import KvSource
from infera_worker_agent.load import EngineLoad
from infera_worker_agent.main import build_plan, main
from infera_worker_agent.host_probe import HostFacts
from infera_worker_agent.planes import plane_problems, plane_warnings
from infera_worker_agent.service import Agent
from infera_worker_agent.settings import parse_agent_cli

ETCD = ["--etcd-endpoint", "10.0.0.10:2379"]
NO_BROKER = ["--discovery-backend", "etcd", "--request-transport", "http", "--kv-event-transport", "zmq", *ETCD]


def settings(*args: str):
    return parse_agent_cli(["--engine", "mock", *args])[0]


@pytest.mark.parametrize("discovery, requests, kv", list(itertools.product(("nats", "etcd"), ("nats", "http"),
                                                                           ("nats", "zmq"))))
def test_nats_is_used_exactly_when_one_plane_is_on_it(discovery, requests, kv):
    s = settings("--discovery-backend", discovery, "--request-transport", requests, "--kv-event-transport", kv, *ETCD)
    expected = tuple(f"--{flag} nats" for flag, value in
                     (("discovery-backend", discovery), ("request-transport", requests), ("kv-event-transport", kv))
                     if value == "nats")
    assert s.nats_uses() == expected


def test_the_no_broker_plane_needs_no_nats_and_discovery_alone_on_nats_is_fine():
    assert settings(*NO_BROKER).nats_uses() == ()
    only_discovery = settings("--request-transport", "http", "--kv-event-transport", "zmq")
    assert only_discovery.nats_uses() == ("--discovery-backend nats",)
    assert plane_problems(only_discovery, "10.0.0.5", [KvSource(0, "tcp://*:5557", "tcp://*:5558")]) == []


@pytest.mark.parametrize("host", ["0.0.0.0", "*", "::", "[::]"])
def test_a_wildcard_advertise_host_is_refused_when_the_fleet_dials_the_engine(host):
    problems = plane_problems(settings(*NO_BROKER), host)
    assert len(problems) == 1
    assert "--advertise-host" in problems[0] and "--request-transport http and --kv-event-transport zmq" in problems[0]
    assert plane_problems(settings(), host) == []  # on NATS only the agent dials the engine


@pytest.mark.parametrize("endpoint", ["tcp://10.0.0.9:5557", "ipc:///tmp/kv.sock"])
def test_zmq_plane_refuses_a_publisher_the_indexer_cannot_dial(endpoint):
    sources = [KvSource(0, endpoint)]
    problems = plane_problems(settings(*NO_BROKER), "10.0.0.5", sources)
    assert len(problems) == 1 and problems[0].startswith("--kv-event-transport zmq:")
    assert endpoint in problems[0] and "tcp://*:PORT" in problems[0] and "--kv-event-transport nats" in problems[0]
    assert plane_problems(settings(), "10.0.0.5", sources) == []  # the agent's relay binds for it on NATS
    assert plane_problems(settings(*NO_BROKER), "10.0.0.5", [KvSource(0, "tcp://0.0.0.0:5557")]) == []


def test_a_loopback_advertise_host_is_only_warned_about_when_the_fleet_spans_hosts():
    assert plane_warnings(settings(*NO_BROKER), "127.0.0.1")
    assert plane_warnings(settings(*NO_BROKER), "10.0.0.5") == []
    assert plane_warnings(settings(), "127.0.0.1") == []
    # discovery on this host too (infera up's fleet): nothing else could dial the engine anyway
    local = ["--discovery-backend", "etcd", "--etcd-endpoint", "127.0.0.1:2379,localhost:2380",
             "--request-transport", "http", "--kv-event-transport", "zmq"]
    assert plane_warnings(settings(*local), "127.0.0.1") == []
    assert plane_warnings(settings("--request-transport", "http", "--nats-url", "nats://127.0.0.1:4222"),
                          "127.0.0.1") == []
    assert plane_warnings(settings("--request-transport", "http", "--nats-url", "nats://10.0.0.2:4222"), "127.0.0.1")


def test_a_refused_mix_exits_2_before_anything_starts_and_print_command_only_notes_it(capsys):
    assert main(["--engine", "mock", *NO_BROKER, "--advertise-host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("infera-worker-agent: error: --advertise-host '0.0.0.0' is a wildcard")
    config = '{"publisher":"zmq","endpoint":"tcp://10.0.0.9:5557"}'
    assert main(["--engine", "mock", *NO_BROKER, "--print-command", "--", "--kv-events-config", config]) == 0
    captured = capsys.readouterr()
    assert "-m infera_mock_engine" in captured.out
    assert "note: launching would be refused: --kv-event-transport zmq:" in captured.err


def test_the_record_advertises_every_rank_publisher_and_replay_at_the_advertise_host():
    s = settings(*NO_BROKER, "--advertise-host", "10.1.2.3", "--max-pending", "9")
    plan = build_plan(s, ["--host", "0.0.0.0", "--port", "30000", "--dp-size", "2"], HostFacts(),
                      find_ports=lambda n: 40000)
    agent = Agent(s, plan)
    agent._kv.sources = (KvSource(0, "tcp://0.0.0.0:40000", "tcp://0.0.0.0:40010"), KvSource(1, "tcp://*:40001"))
    record = agent._record("smol", "active")
    assert record.url == "http://10.1.2.3:30000"
    assert (record.request_transport, record.kv_event_transport, record.max_pending) == ("http", "zmq", 9)
    assert record.kv_events_endpoints == ["tcp://10.1.2.3:40000", "tcp://10.1.2.3:40001"]
    assert record.kv_replay_endpoints == ["tcp://10.1.2.3:40010", ""]


def test_engine_counts_as_idle_after_two_quiet_polls_in_a_row():
    check = IdleCheck()
    busy, idle = EngineLoad(running=1), EngineLoad()
    assert [check.observe(x) for x in (idle, busy, idle, None, idle, EngineLoad(waiting=2), idle)] == [False] * 7
    assert check.observe(idle) is True


async def test_drain_waits_for_the_engine_to_go_idle_or_gives_up_at_the_timeout():
    polls = iter([EngineLoad(running=1), EngineLoad(running=1, waiting=1), EngineLoad(), EngineLoad()])

    async def scrape():
        return next(polls)

    result = await wait_engine_idle(scrape, 60, interval=0)
    assert result.idle and result.last == EngineLoad()
    assert next(polls, "none left") == "none left"  # no poll after the second quiet one

    async def busy():
        return EngineLoad(running=3)

    result = await wait_engine_idle(busy, 0, interval=0)
    assert not result.idle and result.last == EngineLoad(running=3)

    async def broken():
        raise ConnectionError("engine gone")

    assert not (await wait_engine_idle(broken, 0, interval=0)).idle


