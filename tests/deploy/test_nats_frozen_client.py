"""The nats-server that `infera up` starts (and compose.yaml's, with the same settings) drops a
client that stops answering its pings, with its subscriptions: a frozen router (SIGSTOP, a hung
host) no longer takes its share of the routers' queue group for minutes (nats-server's default
ping is every 2 minutes)."""

from __future__ import annotations

import asyncio
import socket
import time

import nats
import nats.errors
import pytest

from infera.procs import free_port, start_nats, stop_process
from infera_common.subjects import ROUTER_QUEUE, ROUTER_ROUTE


@pytest.mark.timeout(120)
async def test_a_subscriber_that_answers_no_ping_is_dropped_within_half_a_minute(tmp_path):
    port = free_port()
    server = start_nats(port, tmp_path / "nats")
    frozen = socket.create_connection(("127.0.0.1", port))
    try:
        frozen.recv(4096)  # INFO
        # a router's subscription, then silence: it reads nothing and answers no PING, as a stopped process
        frozen.sendall(b'CONNECT {"verbose":false,"pedantic":false}\r\n'
                       + f"SUB {ROUTER_ROUTE} {ROUTER_QUEUE} 1\r\nPING\r\n".encode())
        nc = await nats.connect(f"nats://127.0.0.1:{port}")
        try:
            await nc.flush()
            with pytest.raises(nats.errors.TimeoutError):  # subscribed: the request waits for an answer
                await nc.request(ROUTER_ROUTE, b"", timeout=0.5)
            t0 = time.monotonic()
            while True:
                try:
                    await nc.request(ROUTER_ROUTE, b"", timeout=0.5)
                except nats.errors.NoRespondersError:
                    break  # the server dropped it and its queue subscription
                except nats.errors.TimeoutError:
                    assert time.monotonic() - t0 < 60, "the frozen subscriber was never dropped"
                    await asyncio.sleep(1)
            assert time.monotonic() - t0 < 40  # ping every 10 s, 2 unanswered (nats-server's default: 2 min)
        finally:
            await nc.close()
    finally:
        frozen.close()
        stop_process(server)
