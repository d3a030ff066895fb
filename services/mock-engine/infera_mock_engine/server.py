"""Builds the aiohttp application and runs it: in-process (`start_server`, used by tests and
embedders) or as the process's main loop (`run_forever`, used by main)."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from infera_mock_engine import api_cache, api_lora, api_misc, api_openai, api_sglang
from infera_mock_engine.auth import make_auth_middleware
from infera_mock_engine.config import EngineConfig
from infera_mock_engine.engine import Engine
from infera_mock_engine.errors import make_error_middleware
from infera_mock_engine.http_common import ENGINE
from infera_mock_engine.listen import bind_socket
from infera_mock_engine.metrics import make_registry
from infera_mock_engine.tokenizer import ModelTokenizer

log = logging.getLogger("infera_mock_engine")


def create_app(engine: Engine) -> web.Application:
    config = engine.config
    middlewares = [make_error_middleware(config.engine_flavor)]
    if config.api_key is not None:
        middlewares.insert(0, make_auth_middleware(config.engine_flavor, config.api_key))
    app = web.Application(middlewares=middlewares, client_max_size=64 * 1024 * 1024)
    app[ENGINE] = engine
    app[api_misc.REGISTRY] = make_registry(engine)
    app[api_misc.STARTED] = time.monotonic()
    api_misc.add_routes(app)
    api_openai.add_routes(app)
    api_sglang.add_routes(app)
    api_cache.add_routes(app)
    api_lora.add_routes(app, config.engine_flavor)

    async def start_engine(_app: web.Application) -> None:
        await engine.start()

    async def stop_engine(_app: web.Application) -> None:
        await engine.stop()

    app.on_startup.append(start_engine)
    app.on_cleanup.append(stop_engine)
    return app


@dataclass
class RunningServer:
    engine: Engine
    runner: web.AppRunner
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def close(self) -> None:
        await self.runner.cleanup()


async def start_server(config: EngineConfig, sock: socket.socket | None = None,
                       bootstrap_sock: socket.socket | None = None) -> RunningServer:
    """Load the tokenizer, serve on `sock` (or bind config.host:config.port, 0 = a free port), start the
    scheduler (and a prefill's bootstrap server, on `bootstrap_sock` or its configured port)."""
    tokenizer = ModelTokenizer(Path(config.tokenizer_path).expanduser())
    engine = Engine(config, tokenizer)
    engine.bootstrap_sock = bootstrap_sock
    # handler_cancellation: a client that disconnects cancels its handler, which aborts its sequence
    runner = web.AppRunner(create_app(engine), handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
    try:
        await runner.setup()  # starts the engine: KV-event sockets (PublisherError), bootstrap port (BootstrapError)
    except BaseException:
        await runner.cleanup()
        raise
    try:
        if sock is None:
            sock = bind_socket(config.host, config.port)
        await web.SockSite(runner, sock).start()
    except OSError:
        await runner.cleanup()
        raise
    return RunningServer(engine, runner, config.host, sock.getsockname()[1])


async def run_forever(config: EngineConfig, sock: socket.socket | None = None,
                      bootstrap_sock: socket.socket | None = None) -> None:
    t0 = time.monotonic()
    server = await start_server(config, sock, bootstrap_sock)
    log.info(
        "mock %s engine serving %s on %s (up in %.2fs; page_size=%d kv_blocks=%d max_running=%d "
        "max_batched_tokens=%d context=%d speedup=%g%s)",
        config.engine_flavor, config.served_model_name, server.url, time.monotonic() - t0, config.page_size,
        config.num_kv_blocks, config.max_running_requests, config.max_num_batched_tokens, config.context_length,
        config.speedup,
        f" kv_events={server.engine.publisher.bound_endpoint}" if server.engine.publisher else "",
    )
    if config.dp_size > 1 or server.engine.pd is not None:
        pd = server.engine.pd
        log.info("dp_size=%d disaggregation=%s%s", config.dp_size, config.disagg.mode,
                 f" bootstrap_port={pd.bootstrap_port} kv_bytes_per_token={config.disagg.kv_bytes_per_token}"
                 if pd is not None else "")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    engine = server.engine

    def hang() -> None:
        engine.hang_gpu()
        log.warning("simulated GPU hang (SIGUSR1): no step completes until SIGUSR2; HTTP still answers")

    def resume() -> None:
        engine.resume_gpu()
        log.warning("simulated GPU hang over (SIGUSR2)")

    loop.add_signal_handler(signal.SIGUSR1, hang)
    loop.add_signal_handler(signal.SIGUSR2, resume)

    async def announce_ready() -> None:
        await server.engine.ready.wait()
        log.info("engine ready: /health answers 200")

    ready_task = asyncio.create_task(announce_ready())
    await stop.wait()
    log.info("shutting down")
    ready_task.cancel()
    await server.close()
