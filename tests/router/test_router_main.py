"""The ``python -m infera_router`` entry point: flags, refusals, metrics endpoint, clean stop."""

from __future__ import annotations

import asyncio
import json
import signal
import sys

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from infera_common.discovery import Registrar
from infera_common.nats_conn import connect, ensure_request_stream
from infera_common.schemas import RouteReply, decode, encode
from infera_common.subjects import ROUTER_ROUTE

from infera_common.settings import parse_cli

from infera_router import service as service_module
from infera_router.main import main
from infera_router.service import RouterService
from infera_router.settings import RouterSettings

from router_helpers import record, route_request


def test_defaults_and_env(monkeypatch):
    settings, _ = parse_cli(RouterSettings, [], prog="infera-router")
    assert (settings.router_policy, settings.lease_max_age, settings.metrics_bind_port()) == ("kv-aware", 900.0, 9100)
    monkeypatch.setenv("INFERA_ROUTER_POLICY", "least-loaded")
    settings, _ = parse_cli(RouterSettings, ["--lease-max-age", "30"], prog="infera-router")
    assert settings.router_policy == "least-loaded" and settings.lease_max_age == 30.0
    a, b = RouterSettings().resolved_router_id(), RouterSettings().resolved_router_id()
    assert a != b


@pytest.mark.parametrize("argv, needle", [
    (["--router-policy", "fastest"], "--router-policy"),
    (["--lease-max-age", "0"], "--lease-max-age"),
    (["--router-id", "has.dot"], "--router-id"),
    (["--session-affinity", "always"], "--session-affinity"),
    (["--session-affinity-ttl-seconds", "0"], "--session-affinity-ttl-seconds"),
    (["--session-affinity-ttl-seconds", "86401"], "--session-affinity-ttl-seconds"),
    (["--pd-prefill-guard-release", "headers"], "--pd-prefill-guard-release"),
    (["--breaker-failure-threshold", "0"], "--breaker-failure-threshold"),
    (["--kv-decode-weight", "-1"], "--kv-decode-weight"),
    (["--breaker-cooldown-s", "10", "--breaker-max-cooldown-s", "5"], "--breaker-max-cooldown-s"),
])
def test_bad_flags_exit_2_naming_the_flag(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and needle in capsys.readouterr().err


async def test_unreachable_nats_fails_with_a_clear_error(monkeypatch):
    monkeypatch.setattr(service_module, "NATS_CONNECT_TIMEOUT", 0.5)
    router = RouterService(RouterSettings(nats_url="nats://127.0.0.1:1"))
    with pytest.raises(ConnectionError, match="--nats-url"):
        await router.start()
    await router.stop()


async def test_sigterm_while_waiting_for_nats_stops_at_once(subprocess_env):
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "infera_router", "--nats-url", "nats://127.0.0.1:1", "--metrics-port", "0",
        env=subprocess_env, stderr=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.DEVNULL,
    )
    try:
        await _read_until(proc.stderr, "metrics_serving")
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 5) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def _read_until(stream: asyncio.StreamReader, event: str, timeout: float = 15.0) -> dict:
    async def scan() -> dict:
        while True:
            line = await stream.readline()
            if not line:
                raise AssertionError(f"router exited before logging {event}")
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if entry.get("event") == event:
                return entry
    return await asyncio.wait_for(scan(), timeout)


async def test_router_process_serves_routes_metrics_and_stops_on_sigterm(nats_server, subprocess_env):
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "infera_router", "--nats-url", nats_server, "--metrics-port", "0",
        "--router-id", "rproc", env=subprocess_env, stderr=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.DEVNULL,
    )
    nc = await connect(nats_server, "test-client")
    reg = None
    try:
        port = (await _read_until(proc.stderr, "metrics_serving"))["port"]
        assert port > 0
        serving = await _read_until(proc.stderr, "router_serving")
        assert serving["router_id"] == "rproc" and serving["policy"] == "kv-aware"
        js = nc.jetstream()
        await ensure_request_stream(js, "w1", 4, max_age=60)
        reg = Registrar(js, record("w1"))
        await reg.start()
        await _read_until(proc.stderr, "worker_join")
        garbage = decode(RouteReply, (await nc.request(ROUTER_ROUTE, b"\x00junk", timeout=5)).data)
        assert garbage.status == 400
        reply = decode(RouteReply, (await nc.request(ROUTER_ROUTE, encode(route_request()), timeout=5)).data)
        assert (reply.status, reply.worker_id, reply.router_id) == (200, "w1", "rproc")
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{port}/metrics") as resp:
                text = await resp.text()
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for fam in text_string_to_metric_families(text) for s in fam.samples}
        assert samples[("infera_router_routed_total", (("model", "m"), ("status", "200"), ("worker", "w1")))] == 1
        assert samples[("infera_router_bad_messages_total", (("kind", "route"),))] == 1
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 10) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        if reg is not None:
            await reg.stop()
        await nc.close()


async def test_router_stops_on_sigterm_even_when_nats_is_already_gone(tmp_path, subprocess_env):
    from infera.procs import free_port, start_nats, stop_process

    port = free_port()
    nats = start_nats(port, tmp_path / "js")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "infera_router", "--nats-url", f"nats://127.0.0.1:{port}", "--metrics-port", "0",
        env=subprocess_env, stderr=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.DEVNULL,
    )
    try:
        await _read_until(proc.stderr, "router_serving")
        stop_process(nats)  # the broker goes first (a whole node being shut down)
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    finally:
        stop_process(nats)
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
