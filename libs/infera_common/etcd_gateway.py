"""etcd v3 through its JSON gateway: the handful of calls discovery needs, over aiohttp.

etcd (3.4+) serves a JSON translation of its gRPC API on the same client URL as gRPC itself
(``/v3/kv/range``, ``/v3/kv/put``, ``/v3/lease/grant|keepalive|revoke``, ``/v3/watch``,
``/v3/maintenance/status``). Keys and values are base64 in JSON; 64-bit integers are strings.
A watch is one long POST whose response streams one JSON object per line.

``--etcd-endpoint`` is ``host:port`` (or ``http://host:port``), or several comma-separated: a call
that cannot reach one endpoint tries the next. Every failure to reach etcd raises
``EtcdUnavailable`` naming the endpoint and the flag; an error etcd itself answers raises
``EtcdError``.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp

FLAG = "--etcd-endpoint"
#: gRPC status codes that mean "try again later" rather than "you asked for something wrong".
_RETRYABLE_CODES = {4, 14}  # DEADLINE_EXCEEDED, UNAVAILABLE (e.g. no leader yet)


class EtcdUnavailable(ConnectionError):
    """etcd could not be reached (refused, timed out, not answering as etcd, stream cut)."""


class EtcdError(RuntimeError):
    """etcd answered with an error."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"etcd error {code}: {message}")
        self.code = code


@dataclass(frozen=True, slots=True)
class KeyValue:
    key: str
    value: bytes
    mod_revision: int
    lease: int = 0


@dataclass(frozen=True, slots=True)
class WatchEvent:
    kind: Literal["put", "delete"]
    kv: KeyValue


def parse_endpoints(spec: str) -> list[str]:
    """``host:port[,host:port...]`` (an ``http://`` scheme is allowed) -> base URLs; ValueError if malformed."""
    bases = []
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            continue
        scheme, sep, rest = item.partition("://")
        if not sep:
            scheme, rest = "http", item
        host, colon, port = rest.rstrip("/").rpartition(":")
        if scheme not in ("http", "https") or not colon or not host or not port.isdigit() or "/" in host:
            raise ValueError(f"{item!r} is not host:port")
        bases.append(f"{scheme}://{host}:{int(port)}")
    if not bases:
        raise ValueError("no endpoint given")
    return bases


def prefix_range_end(prefix: bytes) -> bytes:
    """The ``range_end`` that makes a range or watch cover every key starting with ``prefix``."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"  # empty prefix: every key


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _kv(raw: dict[str, Any]) -> KeyValue:
    return KeyValue(
        key=base64.b64decode(raw.get("key", "")).decode(),
        value=base64.b64decode(raw.get("value", "")),
        mod_revision=int(raw.get("mod_revision", 0)),
        lease=int(raw.get("lease", 0)),
    )


def _revision(msg: dict[str, Any]) -> int:
    return int(msg.get("header", {}).get("revision", 0))


class EtcdClient:
    """A small etcd v3 client on the JSON gateway; one aiohttp session, opened on first use."""

    def __init__(self, endpoints: str, *, timeout: float = 3.0) -> None:
        try:
            self._bases = parse_endpoints(endpoints)
        except ValueError as exc:
            raise ValueError(f"{FLAG} {endpoints!r}: {exc} (expected host:port[,host:port])") from exc
        self.spec = endpoints
        self.timeout = timeout
        self._current = 0
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession()
        return self._session

    def _unavailable(self, base: str, why: object) -> EtcdUnavailable:
        return EtcdUnavailable(f"etcd at {base} is unreachable ({why}); check {FLAG} (given {self.spec!r})")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST one unary gateway call, trying each endpoint once from the last one that worked."""
        last: EtcdUnavailable | None = None
        for i in range(len(self._bases)):
            index = (self._current + i) % len(self._bases)
            try:
                result = await self._post(self._bases[index], path, body)
            except EtcdUnavailable as exc:
                last = exc
                continue
            self._current = index
            return result
        assert last is not None
        raise last

    async def _post(self, base: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        timeout = aiohttp.ClientTimeout(total=self.timeout)
        try:
            async with self._http().post(base + path, json=body, timeout=timeout) as resp:
                text = await resp.text()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise self._unavailable(base, self._why(exc)) from exc
        return self._decode(base, text)

    def _why(self, exc: BaseException) -> str:
        if isinstance(exc, asyncio.TimeoutError):
            return f"no answer within {self.timeout:g}s"
        return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__

    def _decode(self, base: str, text: str | bytes) -> dict[str, Any]:
        try:
            msg = json.loads(text)
        except ValueError:
            raise self._unavailable(base, f"does not answer as etcd v3: {str(text)[:80]!r}") from None
        if not isinstance(msg, dict):
            raise self._unavailable(base, f"does not answer as etcd v3: {str(text)[:80]!r}")
        if "error" in msg or ("code" in msg and "message" in msg):
            err = msg["error"] if isinstance(msg.get("error"), dict) else msg  # streams nest the error
            code = int(err.get("grpc_code", err.get("code", 2)))
            message = str(err.get("message") or err.get("error"))
            if code in _RETRYABLE_CODES:
                raise self._unavailable(base, message)
            raise EtcdError(code, message)
        return msg

    # --- kv -----------------------------------------------------------------------------------

    async def put(self, key: str, value: bytes, lease: int = 0) -> int:
        """Store ``value`` at ``key`` (bound to ``lease`` when non-zero); returns the new revision."""
        body: dict[str, Any] = {"key": _b64(key.encode()), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        return _revision(await self.call("/v3/kv/put", body))

    async def get(self, key: str) -> KeyValue | None:
        """The value at ``key`` exactly; None when there is none."""
        kvs = (await self.call("/v3/kv/range", {"key": _b64(key.encode())})).get("kvs", [])
        return _kv(kvs[0]) if kvs else None

    async def create(self, key: str, value: bytes, lease: int = 0) -> bool:
        """Store ``value`` at ``key`` only if there is none (one transaction); False when there is."""
        put: dict[str, Any] = {"key": _b64(key.encode()), "value": _b64(value)}
        if lease:
            put["lease"] = str(lease)
        msg = await self.call("/v3/kv/txn", {
            "compare": [{"key": _b64(key.encode()), "target": "VERSION", "result": "EQUAL", "version": "0"}],
            "success": [{"request_put": put}],
        })
        return bool(msg.get("succeeded"))

    async def range_prefix(self, prefix: str) -> tuple[int, list[KeyValue]]:
        """Every key under ``prefix`` and the store revision the listing was read at."""
        raw = prefix.encode()
        msg = await self.call("/v3/kv/range", {"key": _b64(raw), "range_end": _b64(prefix_range_end(raw))})
        return _revision(msg), [_kv(kv) for kv in msg.get("kvs", [])]

    # --- leases -------------------------------------------------------------------------------

    async def grant(self, ttl: int) -> tuple[int, int]:
        """A new lease: (id, ttl etcd granted)."""
        msg = await self.call("/v3/lease/grant", {"TTL": str(ttl)})
        return int(msg["ID"]), int(msg.get("TTL", ttl))

    async def keepalive(self, lease: int) -> int:
        """Refresh ``lease``; returns its new TTL, 0 when etcd no longer has it."""
        msg = await self.call("/v3/lease/keepalive", {"ID": str(lease)})
        return int(msg.get("result", msg).get("TTL", 0))

    async def revoke(self, lease: int) -> None:
        """Revoke ``lease`` and delete its keys; a lease already gone is not an error."""
        try:
            await self.call("/v3/lease/revoke", {"ID": str(lease)})
        except EtcdError as exc:
            if exc.code != 5:  # NOT_FOUND: expired already
                raise

    async def status(self) -> int:
        """A cheap round trip (maintenance status); returns the store revision."""
        return _revision(await self.call("/v3/maintenance/status", {}))

    # --- watch --------------------------------------------------------------------------------

    async def watch_prefix(self, prefix: str, start_revision: int) -> AsyncIterator[list[WatchEvent]]:
        """Changes under ``prefix`` from ``start_revision`` on, one batch per etcd response.

        Yields an empty batch once the watch is established. Ends only by raising: ``EtcdUnavailable``
        when the stream is cut, ``EtcdError`` when etcd cancels the watch (e.g. the revision was
        compacted). The caller re-lists and watches again.
        """
        raw = prefix.encode()
        create = {"key": _b64(raw), "range_end": _b64(prefix_range_end(raw)), "start_revision": str(start_revision)}
        base = self._bases[self._current]
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.timeout, sock_read=None)
        try:
            async with self._http().post(base + "/v3/watch", json={"create_request": create}, timeout=timeout) as resp:
                if resp.status != 200:
                    self._decode(base, await resp.text())
                    raise self._unavailable(base, f"watch answered HTTP {resp.status}")
                buf = bytearray()
                async for chunk in resp.content.iter_any():
                    buf += chunk
                    while (nl := buf.find(b"\n")) >= 0:
                        line, buf = bytes(buf[:nl]), buf[nl + 1:]
                        if line.strip():
                            yield self._watch_batch(base, line)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            self._current = (self._current + 1) % len(self._bases)
            raise self._unavailable(base, self._why(exc)) from exc
        raise self._unavailable(base, "watch stream ended")

    def _watch_batch(self, base: str, line: bytes) -> list[WatchEvent]:
        result = self._decode(base, line).get("result", {})
        if result.get("canceled"):
            reason = result.get("cancel_reason") or f"compacted at revision {result.get('compact_revision', '?')}"
            raise EtcdError(11, f"watch canceled: {reason}")
        return [
            WatchEvent("delete" if ev.get("type") == "DELETE" else "put", _kv(ev.get("kv", {})))
            for ev in result.get("events", [])
        ]
