"""A worker-agent told to stop while its nats-server is gone: it still finishes what runs and exits
at once, instead of waiting out a broker timeout for every step of its way out."""

from __future__ import annotations

import asyncio
import os
import signal

from infera.procs import free_port, start_nats, stop_process
from infera_common.nats_conn import connect

from .agent_proc import AgentProc, alive, group_members
from .test_agent_process import Client, chat, eventually


async def test_sigterm_during_a_broker_outage_finishes_the_running_request_and_exits_without_broker_waits(
        tmp_path, subprocess_env):
    port = free_port()
    nats = start_nats(port, tmp_path / "js")
    agent = AgentProc(f"nats://127.0.0.1:{port}", tmp_path, subprocess_env, "w-outage").start()
    nc = await connect(f"nats://127.0.0.1:{port}", "agent-test")
    bus = await Client(nc).start()
    try:
        await bus.active("w-outage")
        engine_pid = agent.engine_pid()
        _, sub = await bus.submit("w-outage", chat(250, stream=True))  # ~1.5 s of decoding
        assert (await bus.frames(sub, n=1))[0].kind == "head"
        stop_process(nats)  # the broker goes away with the request still decoding
        assert await eventually(lambda: agent.event("nats_disconnected") is not None, 10)

        os.kill(agent.pid, signal.SIGTERM)
        # Each broker step of the way out (status, seal, queue state, leave, stream delete) used to wait
        # out nats-py's 5 s request timeout: ~25 s in all. Now they are skipped, the running request
        # still ends in the engine, and the agent exits with the engine stopped.
        assert await asyncio.to_thread(agent.wait, 12) == 0, agent.err_path.read_text()[-3000:]
        events = [e.get("event") for e in agent.logs()]
        assert "deregister_skipped" in events and "deregister_failed" not in events
        assert "drain_incomplete_cancelled" not in events  # the request was left to finish, not cut
        assert not alive(engine_pid) and not group_members(engine_pid)
    finally:
        await bus.watcher.stop()
        await nc.close()
        agent.cleanup()
        stop_process(nats)
