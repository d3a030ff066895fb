"""``python -m infera_kv_indexer`` as a process: flags, refusals, metrics, and rebuild by replay."""

from __future__ import annotations

import asyncio
import json
import signal
import sys

import aiohttp
import pytest

from infera_common.discovery import Registrar
from infera_common.nats_conn import connect
from infera_kv_indexer.main import main
from tests.kv_indexer.kv_fakes import FakeEngine, depths, query, record, tokens
from tests.kv_indexer.test_kv_service import ask, until


class IndexerProc:
    """The indexer as a child process, its JSON log lines read from stderr."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    @classmethod
    async def start(cls, env: dict[str, str], *args: str) -> "IndexerProc":
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "infera_kv_indexer", "--metrics-port", "0", *args,
            env=env, stderr=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.DEVNULL,
        )
        return cls(proc)

    async def wait_for(self, event: str, timeout: float = 20.0) -> dict:
        async def scan() -> dict:
            assert self.proc.stderr is not None
            while True:
                line = await self.proc.stderr.readline()
                if not line:
                    raise AssertionError(f"indexer exited ({self.proc.returncode}) before logging {event}")
                try:
                    entry = json.loads(line)
                except ValueError:
                    continue
                if entry.get("event") == event:
                    return entry
        return await asyncio.wait_for(scan(), timeout)

    async def kill(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()


def test_defaults_flags_and_refusals(capsys):
    from infera_common.settings import parse_cli
    from infera_kv_indexer.settings import KvIndexerSettings

    settings, _ = parse_cli(KvIndexerSettings, [], prog="infera-kv-indexer")
    assert (settings.metrics_bind_port(), settings.kv_event_max_age, settings.kv_event_max_bytes) == (
        9300, 3600.0, 1 << 30)
    zmq, _ = parse_cli(KvIndexerSettings, ["--kv-event-transport", "zmq"], prog="infera-kv-indexer")
    assert zmq.kv_replay_timeout == 3.0
    # values that would make the shared stream keep next to nothing are refused, naming the flag
    for flag, value in (("--kv-event-max-age", "0"), ("--kv-event-max-age", "3"), ("--kv-event-max-age", "0.001"),
                        ("--kv-event-max-bytes", "10")):
        with pytest.raises(SystemExit) as exc:
            main([flag, value])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and flag in err and ("60" in err or "1048576" in err), err


async def test_sigterm_while_waiting_for_nats_stops_at_once(subprocess_env):
    proc = await IndexerProc.start(subprocess_env, "--nats-url", "nats://127.0.0.1:1")
    try:
        await proc.wait_for("metrics_serving")
        proc.proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.proc.wait(), 5) == 0
    finally:
        await proc.kill()


@pytest.mark.parametrize("relay_kind", ["blocks", "batch"])  # the worker-agent's relays; raw engine batches
async def test_a_restarted_indexer_rebuilds_by_replay_and_answers_the_same(nats_server, subprocess_env, relay_kind,
                                                                           monkeypatch):
    monkeypatch.setattr(FakeEngine, "relay_kind", relay_kind)
    nc = await connect(nats_server, "kv-test")
    js = nc.jetstream()
    regs = [Registrar(js, record(w)) for w in ("vl", "sg", "dp")]
    first = second = None
    try:
        first = await IndexerProc.start(subprocess_env, "--nats-url", nats_server)
        port = (await first.wait_for("metrics_serving"))["port"]
        await first.wait_for("kv_indexer_serving")
        for reg in regs:
            await reg.start()
        vl, sg = FakeEngine("vl", "vllm"), FakeEngine("sg", "sglang")
        dp0, dp1 = FakeEngine("dp", dp_rank=0), FakeEngine("dp", "sglang", dp_rank=1)
        shared, other = tokens(40), tokens(24, start=9000)
        chat = shared + tokens(8, start=4000)
        for engine, events in [
            (vl, [vl.stored(shared)]), (vl, [vl.stored(chat)]), (vl, [vl.removed(chat, 10)]),
            (sg, [sg.stored(shared[:24])]), (sg, [sg.stored(other)]),
            (dp0, [dp0.stored(shared[:8])]), (dp1, [dp1.stored(chat)]),
        ]:
            await js.publish(engine.subject, engine.relay(*events))
        expected = {("vl", 0): 10, ("sg", 0): 6, ("dp", 0): 2, ("dp", 1): 12}
        await until(nc, query(chat), lambda r: depths(r) == expected)
        gauge = 'infera_kv_indexer_worker_blocks{worker="dp"} 14.0'  # set on the service's next tick (1 s)
        async with aiohttp.ClientSession() as http:
            for _ in range(50):
                async with http.get(f"http://127.0.0.1:{port}/metrics") as resp:
                    text = await resp.text()
                if gauge in text:
                    break
                await asyncio.sleep(0.1)
        assert f'infera_kv_indexer_relay_messages_total{{kind="{relay_kind}"}} 7.0' in text
        if relay_kind == "batch":  # translated here (the agent's relays arrive translated)
            assert 'infera_kv_indexer_events_applied_total{type="BlockStored"} 6.0' in text
        assert gauge in text
        assert 'infera_kv_indexer_blocks_applied_total{op="stored"} 38.0' in text  # 12 + 12 + 2 + 12
        assert 'infera_kv_indexer_blocks_applied_total{op="removed"} 2.0' in text

        await first.kill()  # no clean shutdown
        # while it is down: the SGLang engine evicts, a vLLM batch is relayed twice (agent replay)
        await js.publish(sg.subject, sg.relay(sg.removed(shared[:24], 4)))
        again = vl.relay(vl.stored(other))
        await js.publish(vl.subject, again)
        await js.publish(vl.subject, again)

        second = await IndexerProc.start(subprocess_env, "--nats-url", nats_server)
        serving = await second.wait_for("kv_indexer_serving")
        assert serving["workers_seen"] == 3
        expected[("sg", 0)] = 4
        assert depths(await ask(nc, query(chat))) == expected  # at once: serving follows the replay
        assert depths(await ask(nc, query(other))) == {("sg", 0): 6, ("vl", 0): 6}
        second.proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(second.proc.wait(), 10) == 0
    finally:
        for proc in (first, second):
            if proc is not None:
                await proc.kill()
        for reg in regs:
            await reg.stop()
        await nc.close()


async def test_kv_event_transport_zmq_reads_the_publisher_and_answers_over_nats(nats_server, subprocess_env):
    from infera_common.subjects import KV_EVENT_STREAM
    from nats.js.errors import NotFoundError
    from tests.kv_indexer.zmq_helpers import FakePublisher

    pub = FakePublisher()
    engine = FakeEngine("zw")
    prompt = tokens(16)
    await pub.send(0, engine.batch([engine.stored(prompt)]), skip=True)  # only the replay socket has it
    nc = await connect(nats_server, "kv-test")
    reg = Registrar(nc.jetstream(), pub.record("zw"))
    proc = None
    try:
        await reg.start()
        proc = await IndexerProc.start(subprocess_env, "--nats-url", nats_server, "--kv-event-transport", "zmq")
        serving = await proc.wait_for("kv_indexer_serving")
        assert (serving["kv_event_transport"], serving["zmq_workers"], serving["workers_seen"]) == ("zmq", 1, 1)
        assert depths(await ask(nc, query(prompt))) == {("zw", 0): 4}
        with pytest.raises(NotFoundError):
            await nc.jetstream().stream_info(KV_EVENT_STREAM)
        proc.proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.proc.wait(), 10) == 0
    finally:
        if proc is not None:
            await proc.kill()
        await reg.stop()
        await nc.close()
        await pub.close()
