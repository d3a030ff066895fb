"""A hung engine whose /health still passes (vLLM's reports only a dead engine core): the canary.

The mock engine simulates the hang (``Engine.hang_gpu``; SIGUSR1 in a process): no scheduler step
ends while its HTTP side answers.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web

from infera_mock_engine.main import parse_args
from infera_mock_engine.server import start_server
from infera_worker_agent.health import (
    Canary, HealthWatch, ProbeFailRule, StallProbe, engine_stall_probe, send_canary,
)
from infera_worker_agent.load import scrape_engine


@pytest.fixture
async def vllm_engine(model_dir):
    config, _ = parse_args(["--model-path", str(model_dir), "--port", "0", "--engine-flavor", "vllm",
                            "--served-model-name", "smol", "--speedup", "10"])
    server = await start_server(config)
    session = aiohttp.ClientSession()
    yield server, session
    server.engine.resume_gpu()
    await session.close()
    await server.close()


async def test_the_canary_is_answered_by_a_working_engine_and_refused_for_a_wrong_model(vllm_engine):
    server, session = vllm_engine
    assert await send_canary(session, server.url, "smol", 5, lambda: False) is Canary.ANSWERED
    assert await send_canary(session, server.url, "nope", 5, lambda: False) is Canary.REFUSED


async def test_a_hung_gpu_leaves_the_canary_silent_and_the_engine_drops_it(vllm_engine):
    server, session = vllm_engine
    server.engine.hang_gpu()
    assert await send_canary(session, server.url, "smol", 0.5, lambda: False, poll=0.05) is Canary.SILENT
    await asyncio.sleep(0.1)
    held = server.engine.totals()  # the canary and its abort wait for the scheduler, as in vLLM
    assert held.running + held.waiting == 0 and held.stats.finished == {}
    server.engine.resume_gpu()
    await asyncio.sleep(0.1)
    after = server.engine.totals()  # then the canary is taken and dropped at once
    assert after.running + after.waiting == 0 and after.stats.finished == {"abort": 1}


async def test_progress_elsewhere_passes_the_canary(vllm_engine):
    server, session = vllm_engine
    server.engine.hang_gpu()
    assert await send_canary(session, server.url, "smol", 5, lambda: True, poll=0.05) is Canary.PROGRESS


async def test_no_connection_is_a_failed_canary(vllm_engine):
    _, session = vllm_engine
    assert await send_canary(session, "http://127.0.0.1:9", "smol", 2, lambda: False) is Canary.FAILED


async def test_health_round_on_an_engine_that_holds_work_and_counts_no_token(vllm_engine):
    """/health passes throughout (vLLM's), yet the watch finds the hang and then the recovery."""
    server, session = vllm_engine
    url = server.url
    last = {}

    async def scrape():
        last["load"] = await scrape_engine(session, f"{url}/metrics", 2)

    outcomes: list[Canary] = []
    changes: list[bool] = []

    async def on_change(healthy: bool) -> None:
        changes.append(healthy)

    probe = engine_stall_probe(session, url, "smol", lambda: last["load"], in_flight=lambda: 0)
    watch = HealthWatch(session, url, interval=0.1, timeout=0.5, failures=3, on_change=on_change, stall=probe,
                        on_canary=lambda _reason, outcome: outcomes.append(outcome))
    long = asyncio.create_task(session.post(f"{url}/v1/completions",
                                            json={"model": "smol", "prompt": "tell", "max_tokens": 3000}))
    await asyncio.sleep(0.3)
    await scrape()
    await watch.probe_once()  # the first round only takes note
    server.engine.hang_gpu()
    await asyncio.sleep(0.1)
    await scrape()
    await watch.probe_once()  # (the counters may still have moved since the first round)
    await scrape()
    await watch.probe_once()  # at the latest now a whole round with work and no token: canary, silent
    assert outcomes and set(outcomes) == {Canary.SILENT} and not watch.liveness.healthy
    server.engine.resume_gpu()
    await asyncio.sleep(0.2)
    await scrape()
    await watch.probe_once()  # tokens counted again: healthy, no canary needed
    assert watch.liveness.healthy and set(outcomes) == {Canary.SILENT}
    long.cancel()


async def test_a_refused_canary_counts_as_healthy_and_is_logged_once(vllm_engine, capsys):
    server, session = vllm_engine
    url = server.url
    refused = []

    async def canary(timeout, moved, rank):
        return await send_canary(session, url, "not-served", timeout, moved, dp_rank=rank)

    async def on_change(_healthy: bool) -> None:
        pass

    watch = HealthWatch(session, url, interval=0.1, timeout=2, failures=1, on_change=on_change,
                        stall=StallProbe(work=lambda: 1, progress=lambda: 5.0, canary=canary),
                        on_canary=lambda _reason, outcome: refused.append(outcome))
    for _ in range(4):
        await watch.probe_once()
    assert refused == [Canary.REFUSED] * 3 and watch.liveness.healthy  # the first round only takes note
    captured = capsys.readouterr()
    assert (captured.out + captured.err).count("engine_canary_refused") == 1


async def test_a_failed_probe_after_a_round_with_work_and_no_token_is_unhealthy_at_once():
    """A frozen engine process (SIGSTOP, a wedged host) times its /health out. Three such probes
    took ~2 minutes at the defaults; when the engine held requests and counted no token through
    the round before, or its /metrics has been silent as long, the first failed probe is enough.
    While tokens still move and its metrics answer, it is one strike."""
    frozen = asyncio.Event()

    async def health(_request):
        if frozen.is_set():
            await asyncio.sleep(3600)
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    tokens = {"count": 0.0}

    canaries = []

    async def canary(_timeout, _moved, rank):
        canaries.append(rank)
        return Canary.ANSWERED

    async def on_change(_healthy: bool) -> None:
        pass

    silent = {"for": 0.0}  # seconds since the engine's /metrics last answered

    def watch() -> HealthWatch:
        return HealthWatch(session, url, interval=0.1, timeout=0.3, failures=3, on_change=on_change,
                           stall=StallProbe(work=lambda: 2, progress=lambda: tokens["count"], canary=canary,
                                            metrics_silent_for=lambda: silent["for"]))

    async with aiohttp.ClientSession() as session:
        try:
            moving = watch()
            await moving.probe_once()
            frozen.set()
            tokens["count"] += 10  # tokens counted since the last round: the engine worked
            await moving.probe_once()
            assert moving.liveness.healthy and moving.liveness.failed_in_a_row == 1  # one strike of three

            stuck = watch()
            frozen.clear()
            await stuck.probe_once()  # holds 2 requests
            frozen.set()
            await stuck.probe_once()  # still 2, not one token since, and no answer within the timeout
            assert not stuck.liveness.healthy and canaries == []  # at once, and no canary was needed
            frozen.clear()
            await stuck.probe_once()  # answers again, yet nothing moved: a canary tests it, and it answers
            assert canaries == [None] and stuck.liveness.healthy

            # frozen right after a scrape that saw tokens move: its /metrics is as silent as /health
            frozen_late = watch()
            await frozen_late.probe_once()
            frozen.set()
            tokens["count"] += 10
            silent["for"] = 0.3
            await frozen_late.probe_once()
            assert not frozen_late.liveness.healthy and canaries == [None]

            # an SGLang prefill or decode leg: no canary can test it, the probe rule alone holds
            frozen.clear()
            work = {"n": 0}
            leg = HealthWatch(session, url, interval=0.1, timeout=0.3, failures=3, on_change=on_change,
                              fail_rule=ProbeFailRule(work=lambda: work["n"], metrics_silent_for=lambda: silent["for"]))
            await leg.probe_once()
            frozen.set()
            await leg.probe_once()  # nothing held: a strike, as before
            assert leg.liveness.healthy and leg.liveness.failed_in_a_row == 1
            work["n"] = 3
            silent["for"] = 0.0
            await leg.probe_once()  # work held, but its /metrics answered a moment ago: a strike
            assert leg.liveness.healthy and leg.liveness.failed_in_a_row == 2
            frozen.clear()
            await leg.probe_once()  # answers: the strikes start over
            assert leg.liveness.failed_in_a_row == 0
            frozen.set()
            silent["for"] = 0.3
            await leg.probe_once()  # work held and /metrics as silent as /health: one probe, unhealthy now
            assert not leg.liveness.healthy
            frozen.clear()
            await leg.probe_once()  # its generating /health passes: back
            assert leg.liveness.healthy
        finally:
            await runner.cleanup()
