"""A small Python client for Infera's OpenAI API on NATS (no HTTP hop).

Usage::

    from infera.client import InferaClient, InferaError

    client = InferaClient("nats://127.0.0.1:4222")
    await client.connect()
    try:
        reply = await client.chat({"model": "SmolLM2-135M-Instruct",
                                   "messages": [{"role": "user", "content": "Hello"}]})
        print(reply["choices"][0]["message"]["content"])
        async for chunk in client.stream_chat({"model": "SmolLM2-135M-Instruct",
                                               "messages": [{"role": "user", "content": "Hi"}]}):
            print(chunk["choices"][0]["delta"].get("content", ""), end="")
        print(await client.models())
    except InferaError as err:
        print(err.status, err.error["message"])
    finally:
        await client.close()

Bodies are the OpenAI request bodies as dicts (``stream`` is set by the method). Errors (validation,
unknown model, no worker, timeouts, engine errors) raise ``InferaError(status, error_dict)`` where
``error_dict`` is the OpenAI error object ``{"message", "type", "param", "code"}``. The wire
contract is described in ``infera_common.nats_api``. A completion asks the frontend for ``alive``
messages every third of ``timeout`` and answers them, so that ``timeout`` bounds the frontend's
silence, not how long the engine takes to answer, and a call given up stops the engine's work.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import nats
from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from infera_common import nats_api as api
from infera_common.nats_conn import unsubscribe_quietly
from infera_common.subjects import API_CHAT_COMPLETIONS, API_COMPLETIONS, API_MODELS, API_WORKERS


class InferaError(Exception):
    """An OpenAI-style error answered by Infera: HTTP-like ``status`` and the ``error`` object."""

    def __init__(self, status: int, error: dict[str, Any]) -> None:
        super().__init__(f"{status}: {error.get('message', '')}")
        self.status = status
        self.error = error


def _error_of(status: int, data: bytes) -> InferaError:
    try:
        obj = json.loads(data)
        err = obj["error"] if isinstance(obj, dict) and isinstance(obj.get("error"), dict) else None
    except ValueError:
        err = None
    return InferaError(status, err or {"message": data.decode("utf-8", "replace") or f"HTTP {status}",
                                       "type": "api_error", "param": None, "code": None})


class InferaClient:
    """Talks to Infera frontends over NATS; several frontends share the subjects (queue group)."""

    def __init__(self, nats_url: str, *, timeout: float = 120.0, name: str = "infera-client") -> None:
        """``timeout``: seconds without a word from the frontend (a reply, a message of a stream, or the
        ``alive`` messages it sends while it works on a completion) after which a call gives up (504)."""
        self.nats_url = nats_url
        self.timeout = timeout
        self.name = name
        self._nc: NATS | None = None

    async def connect(self) -> None:
        self._nc = await nats.connect(servers=self.nats_url.split(","), name=self.name)

    async def close(self) -> None:
        if self._nc is not None:
            await self._nc.close()
            self._nc = None

    async def __aenter__(self) -> InferaClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def nc(self) -> NATS:
        if self._nc is None:
            raise RuntimeError("InferaClient is not connected: await client.connect() first")
        return self._nc

    # --- the API ---------------------------------------------------------------------------

    async def chat(self, body: dict[str, Any], request_id: str | None = None) -> dict[str, Any]:
        """A chat completion (non-streaming); returns the OpenAI response body."""
        return await self._answer(API_CHAT_COMPLETIONS, {**body, "stream": False}, request_id)

    def stream_chat(self, body: dict[str, Any], request_id: str | None = None) -> AsyncIterator[dict[str, Any]]:
        """A streaming chat completion: yields each chunk (the SSE event payloads)."""
        return self._stream(API_CHAT_COMPLETIONS, {**body, "stream": True}, request_id)

    async def completions(self, body: dict[str, Any], request_id: str | None = None) -> dict[str, Any]:
        """A text completion (non-streaming); returns the OpenAI response body."""
        return await self._answer(API_COMPLETIONS, {**body, "stream": False}, request_id)

    def stream_completions(
        self, body: dict[str, Any], request_id: str | None = None,
    ) -> AsyncIterator[dict[str, Any]]:
        """A streaming text completion: yields each chunk."""
        return self._stream(API_COMPLETIONS, {**body, "stream": True}, request_id)

    async def models(self) -> dict[str, Any]:
        """The OpenAI model list (models with at least one active worker)."""
        return await self._call(API_MODELS)

    async def workers(self) -> dict[str, Any]:
        """Every worker in discovery, as its record."""
        return await self._call(API_WORKERS)

    # --- wire ---------------------------------------------------------------------------------

    def _headers(self, request_id: str | None) -> dict[str, str]:
        every = min(max(self.timeout / 3, api.ALIVE_EVERY_MIN), api.ALIVE_EVERY_MAX)
        headers = {api.HEADER_ALIVE_EVERY: f"{every:g}"}
        if request_id:
            headers[api.HEADER_REQUEST_ID] = request_id
        return headers

    async def _call(self, subject: str) -> dict[str, Any]:
        """One request, one reply (the listings)."""
        try:
            msg = await self.nc.request(subject, b"", timeout=self.timeout)
        except NoRespondersError:
            raise _no_frontend() from None
        except NatsTimeoutError:
            raise InferaError(504, {"message": f"no reply within {self.timeout:g}s", "type": "timeout_error",
                                    "param": None, "code": None}) from None
        headers = msg.headers or {}
        status = int(headers.get(api.HEADER_STATUS, "200"))
        if status >= 400 or headers.get(api.HEADER_KIND) == api.KIND_ERROR:
            raise _error_of(status, msg.data)
        return json.loads(msg.data)

    async def _answer(self, subject: str, body: dict[str, Any], request_id: str | None) -> dict[str, Any]:
        """A non-streaming completion: its one answer, read like a stream's messages."""
        async with aclosing(self._stream(subject, body, request_id)) as messages:
            async for chunk in messages:
                return chunk
        raise InferaError(502, {"message": "the frontend ended the answer without a body", "type": "api_error",
                                "param": None, "code": None})

    async def _stream(
        self, subject: str, body: dict[str, Any], request_id: str | None,
    ) -> AsyncIterator[dict[str, Any]]:
        nc = self.nc
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        try:
            await nc.publish(subject, json.dumps(body).encode(), reply=inbox, headers=self._headers(request_id))
            while True:
                try:
                    msg = await sub.next_msg(timeout=self.timeout)
                except NatsTimeoutError:
                    raise InferaError(504, {"message": f"no message within {self.timeout:g}s", "type":
                                            "timeout_error", "param": None, "code": None}) from None
                headers = msg.headers or {}
                kind = headers.get(api.HEADER_KIND)
                if kind == api.KIND_ALIVE:
                    if msg.reply:  # the frontend checks that we still listen: say so at once
                        await nc.publish(msg.reply, b"")
                    continue
                if kind == api.KIND_DATA:
                    yield json.loads(msg.data)
                elif kind == api.KIND_END:
                    return
                elif headers.get("Status") == "503" and not msg.data:  # NATS: no responders
                    raise _no_frontend()
                else:  # error, or a non-streaming answer
                    status = int(headers.get(api.HEADER_STATUS, "500"))
                    if kind == api.KIND_ERROR or status >= 400:
                        raise _error_of(status, msg.data)
                    yield json.loads(msg.data)
                    return
        finally:
            await unsubscribe_quietly(sub)


def _no_frontend() -> InferaError:
    return InferaError(503, {"message": "no Infera frontend serves the NATS API", "type": "service_unavailable_error",
                             "param": None, "code": None})
