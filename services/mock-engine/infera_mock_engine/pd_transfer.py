"""The simulated KV transfer on the wire: the decode engine PULLS its prompt's KV from the prefill
engine over one HTTP/1.1 connection to the prefill's bootstrap server (`POST /kv/pull`).

Request (JSON): `{"dp_rank": r, "room": R}` (SGLang) or `{"dp_rank": r, "transfer_id": T}` (vLLM), plus
`"prompt_tokens"` and `"rid"`. The prefill answers 200 at once — the connection is the bootstrap
handshake — then, when its KV is ready, one JSON line `{"status": "ok", "prompt_tokens", "nbytes",
"first_token"}` followed by exactly `nbytes` bytes (prompt tokens × --kv-bytes-per-token, sent in
256 KiB chunks, paced to --kv-transfer-bandwidth), or one line `{"status": "error", "reason", "kind"}`.
A connection that closes early means the other side is gone.

Before pulling, the decode finds the prefill's rank: SGLang `GET /route?engine_rank=-1&target_dp_group=-1`
gives `prefill_dp_size` (rank = disagg_prefill_dp_rank, else room % prefill_dp_size); vLLM
`GET /query` maps engine ids to DP ranks. Answers are cached per bootstrap address.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import aiohttp

from infera_mock_engine.pd_request import PREFILL_DEAD, PdRequest, timed_out
from infera_mock_engine.pd_rooms import KvPayload, TransferFailed

CHUNK = 256 * 1024
_ZEROS = memoryview(bytes(CHUNK))


async def send_paced(write: Callable[[memoryview], Any], nbytes: int, bandwidth: float | None,
                     on_sent: Callable[[int], None]) -> None:
    """Write `nbytes` bytes in chunks, never faster than `bandwidth` bytes/s (None: no cap): each chunk
    goes out when the link would have finished carrying it."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    sent = 0
    while sent < nbytes:
        n = min(CHUNK, nbytes - sent)
        if bandwidth:
            delay = t0 + (sent + n) / bandwidth - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
        await write(_ZEROS[:n])
        sent += n
        on_sent(n)


def base_url(addr: str) -> str:
    """`host:port` or `http://host:port[/]` -> `http://host:port`."""
    addr = addr.strip().rstrip("/")
    return addr if "://" in addr else f"http://{addr}"


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


class PrefillDirectory:
    """Decode side: where the KV of a request lives (bootstrap URL and prefill DP rank)."""

    def __init__(self, session: aiohttp.ClientSession) -> None:
        self.session = session
        self._sglang: dict[str, int] = {}  # url -> prefill dp_size
        self._vllm: dict[str, dict[str, int]] = {}  # url -> engine_id -> dp rank

    def forget(self, url: str) -> None:
        self._sglang.pop(url, None)
        self._vllm.pop(url, None)

    async def locate(self, pd: PdRequest) -> tuple[str, int]:
        if pd.protocol == "sglang":
            url = f"http://{_host_port(pd.bootstrap_host or '', pd.bootstrap_port or 0)}"
            dp = self._sglang.get(url)
            if dp is None:
                info = await self._get_json(url + "/route?engine_rank=-1&target_dp_group=-1&target_pp_rank=-1",
                                            f"Could not fetch prefill parallel info from bootstrap_addr: "
                                            f"{_host_port(pd.bootstrap_host or '', pd.bootstrap_port or 0)}")
                dp = info.get("prefill_dp_size") if isinstance(info, dict) else None
                if not isinstance(dp, int) or dp < 1:
                    raise TransferFailed(f"the bootstrap server at {url} answered no prefill_dp_size", "unreachable")
                self._sglang[url] = dp
            rank = pd.prefill_dp_rank if pd.prefill_dp_rank is not None else int(pd.key) % dp
            if not 0 <= rank < dp:
                raise TransferFailed(f"disagg_prefill_dp_rank={rank} but the prefill engine has dp_size={dp}",
                                     "bad_rank")
            return url, rank
        url = base_url(pd.remote_bootstrap_addr or "")
        for attempt in range(2):  # a restarted prefill has new engine ids: ask again once
            table = self._vllm.get(url) if attempt == 0 else None
            if table is None:
                table = self._engine_table(await self._get_json(
                    url + "/query", f"could not query the Mooncake bootstrap server {url}"))
                self._vllm[url] = table
            if pd.remote_engine_id in table:
                return url, table[pd.remote_engine_id]  # type: ignore[index]
        raise TransferFailed(f"remote_engine_id {pd.remote_engine_id!r} is not registered at the bootstrap server "
                             f"{url} (it has {sorted(table)})", "unknown_engine")

    @staticmethod
    def _engine_table(data: Any) -> dict[str, int]:
        table: dict[str, int] = {}
        if isinstance(data, dict):
            for rank, entry in data.items():
                if isinstance(entry, dict) and isinstance(entry.get("engine_id"), str):
                    try:
                        table[entry["engine_id"]] = int(rank)
                    except ValueError:
                        continue
        return table

    async def _get_json(self, url: str, failure: str) -> Any:
        try:
            async with self.session.get(url, timeout=aiohttp.ClientTimeout(total=10)) as r:
                if r.status != 200:
                    raise TransferFailed(f"{failure} (HTTP {r.status})", "unreachable")
                return await r.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, OSError) as e:
            raise TransferFailed(f"{failure} ({type(e).__name__}: {e})", "unreachable") from None


async def pull(session: aiohttp.ClientSession, url: str, rank: int, pd: PdRequest, prompt_tokens: int, rid: str,
               *, started: float, wait: float, on_connected: Callable[[], None],
               on_bytes: Callable[[int], None]) -> KvPayload:
    """Pull the KV of `pd` from DP rank `rank` of the prefill at `url`; raises TransferFailed. `wait` bounds
    the time (from `started`, loop time) until the prefill starts sending, and each later silence."""
    loop = asyncio.get_running_loop()
    body: dict[str, Any] = {"dp_rank": rank, "prompt_tokens": prompt_tokens, "rid": rid}
    body["room" if pd.protocol == "sglang" else "transfer_id"] = pd.key

    def timeout() -> TransferFailed:
        return TransferFailed(timed_out(pd.key, loop.time() - started, "WaitingForInput"), "waiting_timeout")

    try:
        async with session.post(url + "/kv/pull", json=body,
                                timeout=aiohttp.ClientTimeout(total=None, sock_connect=10)) as r:
            if r.status != 200:
                text = (await r.text())[:200]
                raise TransferFailed(f"the prefill refused the KV pull (HTTP {r.status}: {text})", "refused")
            on_connected()
            remaining = started + wait - loop.time()
            if remaining <= 0:
                raise timeout()
            try:
                line = await asyncio.wait_for(r.content.readline(), remaining)
            except asyncio.TimeoutError:
                raise timeout() from None
            header = _header(line)
            if header.get("status") != "ok":
                raise TransferFailed(f"{PREFILL_DEAD} (prefill: {header.get('reason')})",
                                     str(header.get("kind") or "prefill_failed"))
            nbytes = int(header["nbytes"])
            got = 0
            while got < nbytes:
                try:
                    chunk = await asyncio.wait_for(r.content.readany(), wait)
                except asyncio.TimeoutError:
                    raise TransferFailed(f"{PREFILL_DEAD} (no KV bytes for {wait:.1f}s)", "stalled") from None
                if not chunk:
                    raise TransferFailed(f"{PREFILL_DEAD} (the KV connection closed after {got} of {nbytes} bytes)",
                                         "peer_gone")
                got += len(chunk)
                on_bytes(len(chunk))
            try:  # the prefill ends the body once it has recorded the transfer: only then hang up
                await asyncio.wait_for(r.content.read(), wait)
            except asyncio.TimeoutError:
                pass
            first = header.get("first_token")
            return KvPayload(int(header["prompt_tokens"]), nbytes, first if isinstance(first, int) else None)
    except TransferFailed:
        raise
    except (aiohttp.ClientConnectorError, aiohttp.ClientOSError) as e:
        kind = "unreachable" if isinstance(e, aiohttp.ClientConnectorError) else "peer_gone"
        reason = PREFILL_DEAD if kind == "peer_gone" else f"cannot connect to the prefill's bootstrap server {url}"
        raise TransferFailed(f"{reason} ({type(e).__name__}: {e})", kind) from None
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, ConnectionError) as e:
        raise TransferFailed(f"{PREFILL_DEAD} ({type(e).__name__})", "peer_gone") from None


def _header(line: bytes) -> dict[str, Any]:
    try:
        header = json.loads(line)
    except ValueError:
        header = None
    if not isinstance(header, dict):
        raise TransferFailed(f"{PREFILL_DEAD} (the KV connection closed before the prefill answered)", "peer_gone")
    return header
