"""The prefill engine's bootstrap server (aiohttp, its own port: SGLang `--disaggregation-bootstrap-port`,
vLLM VLLM_MOONCAKE_BOOTSTRAP_PORT, default 8998). It answers what the engines' bootstrap servers answer
and carries the simulated KV transfer (pd_transfer.py describes the wire):

- `GET /health` -> `OK` (both engines' bootstrap servers have it);
- SGLang: `GET /route?engine_rank=-1&target_dp_group=-1` -> `{prefill_attn_tp_size, prefill_dp_size,
  prefill_pp_size, prefill_page_size}`; with a rank -> `{rank_ip, rank_port}`; `PUT /route` accepted;
- vLLM: `GET /query` -> `{"<dp_rank>": {"engine_id", "worker_addr": {"0": {"0": "tcp://host:port"}}}}`;
  `POST /register` accepted;
- `POST /kv/pull` -> the KV of one room, when the prefill has computed it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from typing import Any

from aiohttp import web

from infera_mock_engine.listen import bind_socket
from infera_mock_engine.pd_config import DisaggConfig
from infera_mock_engine.pd_rooms import KvPayload, Room, RoomTable, TransferFailed
from infera_mock_engine.pd_stats import PdStats
from infera_mock_engine.pd_transfer import send_paced

log = logging.getLogger("infera_mock_engine.pd")


class BootstrapError(RuntimeError):
    """The bootstrap server could not listen (the message names the address)."""


class BootstrapServer:
    def __init__(self, disagg: DisaggConfig, host: str, dp_size: int, page_size: int, rooms: RoomTable,
                 stats: PdStats) -> None:
        self.disagg = disagg
        self.host = host
        self.dp_size = dp_size
        self.page_size = page_size
        self.rooms = rooms
        self.stats = stats
        self.port: int | None = None  # after start: the port actually bound
        self._runner: web.AppRunner | None = None

    # ---- lifecycle -------------------------------------------------------------
    async def start(self, sock: socket.socket | None = None) -> None:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/route", self._route)
        app.router.add_put("/route", self._accept)
        app.router.add_get("/query", self._query)
        app.router.add_post("/register", self._accept)
        app.router.add_post("/kv/pull", self._pull)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        try:
            if sock is None:
                sock = bind_socket(self.host, self.disagg.bootstrap_port)
            await web.SockSite(self._runner, sock).start()
        except OSError as e:
            await self._runner.cleanup()
            raise BootstrapError(f"cannot listen on the bootstrap port {self.host}:{self.disagg.bootstrap_port}: "
                                 f"{e}") from None
        self.port = sock.getsockname()[1]
        log.info("bootstrap server (%s) on %s:%d", self.disagg.protocol, self.host, self.port)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ---- discovery routes ------------------------------------------------------
    async def _health(self, _request: web.Request) -> web.Response:
        return web.Response(text="OK")

    async def _accept(self, _request: web.Request) -> web.Response:
        return web.Response(text="OK")

    async def _route(self, request: web.Request) -> web.Response:
        try:
            engine_rank = int(request.query.get("engine_rank", "-1"))
            group = int(request.query.get("target_dp_group", "-1"))
        except ValueError:
            return web.json_response({"error": "engine_rank and target_dp_group must be integers"}, status=400)
        if engine_rank == -1 and group == -1:
            return web.json_response({"prefill_attn_tp_size": 1, "prefill_dp_size": self.dp_size,
                                      "prefill_pp_size": 1, "prefill_page_size": self.page_size})
        if not 0 <= group < self.dp_size and group != -1:
            return web.json_response({"error": f"target_dp_group {group} not found"}, status=404)
        return web.json_response({"rank_ip": self.host, "rank_port": self.port})

    async def _query(self, _request: web.Request) -> web.Response:
        addr = f"tcp://{self.host}:{self.port}"
        return web.json_response({
            str(r): {"engine_id": self.disagg.rank_engine_id(r, self.dp_size), "worker_addr": {"0": {"0": addr}}}
            for r in range(self.dp_size)
        })

    # ---- the transfer ----------------------------------------------------------
    async def _pull(self, request: web.Request) -> web.StreamResponse:
        try:
            body = json.loads(await request.read())
            rank = int(body["dp_rank"])
            key: int | str = int(body["room"]) if self.disagg.protocol == "sglang" else str(body["transfer_id"])
            prompt_tokens = int(body.get("prompt_tokens", -1))
        except (ValueError, KeyError, TypeError) as e:
            return web.json_response({"error": f"malformed KV pull request: {type(e).__name__}: {e}"}, status=400)
        if not 0 <= rank < self.dp_size:
            return web.json_response({"error": f"DP rank {rank} does not exist on this prefill engine "
                                               f"(dp_size={self.dp_size})"}, status=404)
        resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        try:
            room = self.rooms.attach((rank, key))
        except TransferFailed as e:
            return await self._answer_error(request, resp, e)
        peer = request.remote or "?"
        try:
            await resp.prepare(request)  # the handshake: the decode now knows it is connected
            await self._send_when_ready(resp, room, prompt_tokens)
        except (asyncio.CancelledError, ConnectionError) as e:
            self.rooms.fail(room, TransferFailed(
                f"Decode instance could be dead: its KV connection from {peer} closed ({type(e).__name__})",
                "peer_gone"))
            if isinstance(e, asyncio.CancelledError):
                raise
        return resp

    async def _send_when_ready(self, resp: web.StreamResponse, room: Room, prompt_tokens: int) -> None:
        await asyncio.wait({room.payload, room.outcome}, return_when=asyncio.FIRST_COMPLETED)
        if room.outcome.done():
            failure = room.outcome.result() or TransferFailed("the room ended", "ended")
            await self._write_error(resp, failure)
            return
        payload: KvPayload = room.payload.result()
        if prompt_tokens >= 0 and prompt_tokens != payload.prompt_tokens:
            failure = TransferFailed(f"the decode's prompt has {prompt_tokens} tokens, the prefill's "
                                     f"{payload.prompt_tokens}: the two halves got different requests", "mismatch")
            self.rooms.fail(room, failure)
            await self._write_error(resp, failure)
            return
        header = {"status": "ok", "prompt_tokens": payload.prompt_tokens, "nbytes": payload.nbytes,
                  "first_token": payload.first_token}
        await resp.write(json.dumps(header).encode() + b"\n")

        def sent(n: int) -> None:
            self.stats.bytes_sent += n

        await send_paced(resp.write, payload.nbytes, self.disagg.kv_transfer_bandwidth, sent)
        self.stats.transfers_sent += 1
        self.rooms.finish(room)  # before the end of the body: the decode hangs up only after it
        await resp.write_eof()

    async def _answer_error(self, request: web.Request, resp: web.StreamResponse,
                            failure: TransferFailed) -> web.StreamResponse:
        await resp.prepare(request)
        await self._write_error(resp, failure)
        return resp

    @staticmethod
    async def _write_error(resp: web.StreamResponse, failure: TransferFailed) -> None:
        line: dict[str, Any] = {"status": "error", "reason": failure.reason, "kind": failure.kind}
        await resp.write(json.dumps(line).encode() + b"\n")
        await resp.write_eof()
