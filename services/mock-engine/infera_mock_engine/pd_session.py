"""One disaggregated request on this engine: a task that drives its KV transfer and feeds its stream.

The sequence's scheduler events (`seq.events`) go through the session to `out`, which the HTTP stream
reads; the session adds the sequence to its rank's scheduler only when it may run, and ends `out` with
`Finished("error", message)` when the transfer fails (the stream turns that into HTTP 500 / an error
frame). `abort()` (abort_request, a client that left, shutdown) ends it at any phase.

- SGLang prefill: wait for the decode to connect (SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT), prefill
  one token, hand the KV to the waiting connection, answer once the decode has it.
- vLLM producer: prefill and answer at once; the finished KV waits for the decode's pull up to
  VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT, then is dropped.
- Decode (both): find the prefill rank, pull the KV (SGLang: within SGLANG_DISAGGREGATION_WAITING_TIMEOUT;
  vLLM: within the abort timeout), then decode with the prompt's KV already present (no prefill cost;
  SGLang's first token is the prefill's, vLLM recomputes the last prompt token).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from infera_mock_engine.pd_request import (
    VLLM_ERROR, PdRequest, decode_failed, prefill_bootstrap_failed, prefill_transfer_failed, timed_out,
)
from infera_mock_engine.pd_rooms import KvPayload, TransferFailed
from infera_mock_engine.pd_transfer import pull
from infera_mock_engine.scheduler import FINISHED, Finished, Sequence

if TYPE_CHECKING:
    from infera_mock_engine.pd_engine import Disaggregation
    from infera_mock_engine.ranks import EngineRank

log = logging.getLogger("infera_mock_engine.pd")
_BOOTSTRAP_KINDS = frozenset({"unreachable", "unknown_engine", "bad_rank", "refused", "duplicate"})


async def first(waits: dict[str, Awaitable[Any]], timeout: float | None = None) -> tuple[str | None, Any]:
    """The first of several awaitables to complete, as (name, result) — earlier names win ties; (None,
    None) on timeout. Coroutines get their own tasks, cancelled when they lose; futures passed in are
    left alone (they may be shared)."""
    futs: dict[str, asyncio.Future] = {}
    own = []
    for name, aw in waits.items():
        if asyncio.isfuture(aw):
            futs[name] = aw  # type: ignore[assignment]
        else:
            futs[name] = asyncio.ensure_future(aw)
            own.append(futs[name])
    try:
        done, _ = await asyncio.wait(futs.values(), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for f in own:
            if not f.done():
                f.cancel()
    for name, f in futs.items():
        if f in done:
            return name, f.result()
    return None, None


class FirstThen:
    """The token source of an SGLang decode: the prefill's first token, then the sequence's own stream
    from its second token on (so PD output equals aggregated output for a deterministic request)."""

    def __init__(self, first_token: int, rest: Callable[[], int]) -> None:
        self.first_token = first_token
        self.rest = rest
        self.used = False

    def __call__(self) -> int:
        if not self.used:
            self.used = True
            self.rest()  # the prefill computed this position: skip it
            return self.first_token
        return self.rest()


class PdSession:
    role = "?"

    def __init__(self, pd: Disaggregation, seq: Sequence, rid: str, rank: EngineRank, req: PdRequest) -> None:
        self.pd = pd
        self.cfg = pd.cfg
        self.seq = seq
        self.rid = rid
        self.rank = rank
        self.req = req
        self.out: asyncio.Queue = asyncio.Queue()
        self.aborted: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.phase = "bootstrap"  # bootstrap -> (transfer) -> running -> done
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.pd.sessions.add(self)
        self.task = asyncio.create_task(self._main(), name=f"pd-{self.role}-{self.rid}")

    def abort(self, message: str) -> None:
        if not self.aborted.done():
            self.aborted.set_result(message)
        self.rank.scheduler.finish(self.seq, "abort", message)  # queued or not: Finished(abort) reaches seq.events

    async def run(self) -> None:
        raise NotImplementedError

    async def _main(self) -> None:
        try:
            await self.run()
        except asyncio.CancelledError:
            self.out.put_nowait(Finished("abort", "the engine is stopping"))
            raise
        except Exception:  # noqa: BLE001 - a bug fails this request, not the engine
            log.exception("PD %s session %s failed", self.role, self.rid)
            self.rank.scheduler.finish(self.seq, "abort", "internal error")
            self.fail("internal error in the mock engine's disaggregation session")
        finally:
            self.phase = "done"
            self.pd.sessions.discard(self)

    # ---- helpers -------------------------------------------------------------------
    def add_to_scheduler(self) -> bool:
        if self.seq.state == FINISHED or self.aborted.done():
            return False
        self.phase = "running"
        self.rank.scheduler.add(self.seq)
        return True

    async def forward(self) -> Finished:
        """Relay the sequence's events to the stream until it finishes."""
        while True:
            ev = await self.seq.events.get()
            self.out.put_nowait(ev)
            if isinstance(ev, Finished):
                return ev

    def fail(self, message: str) -> None:
        self.seq.state = FINISHED  # a late abort is a no-op
        self.out.put_nowait(Finished("error", message))

    def elapsed(self, since: float) -> float:
        return asyncio.get_running_loop().time() - since


class SglangPrefillSession(PdSession):
    role = "prefill"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seq.max_new_tokens, self.seq.limit_reason = 1, "length"  # the prefill makes the first token only

    async def run(self) -> None:
        pd, room_id = self.pd, self.req.key
        t0 = asyncio.get_running_loop().time()
        try:
            room = pd.rooms.open((self.rank.dp_rank, room_id))
        except TransferFailed as failure:
            return self._failed(failure, bootstrap=True)
        name, _ = await first({"attached": room.attached.wait(), "ended": room.outcome, "aborted": self.aborted},
                              timeout=self.cfg.bootstrap_timeout)
        if name == "aborted":
            pd.rooms.fail(room, TransferFailed("the request was aborted on the prefill engine", "aborted"))
            await self.forward()
            return
        if name is None:
            failure = TransferFailed(timed_out(room_id, self.elapsed(t0), "Bootstrapping"), "bootstrap_timeout")
            pd.rooms.fail(room, failure)
            return self._failed(failure, bootstrap=True)
        if name == "ended":
            return self._failed(room.outcome.result(), bootstrap=True)

        self.add_to_scheduler()
        events: list[Any] = []
        while True:
            name, value = await first({"event": self.seq.events.get(), "ended": room.outcome})
            if name == "ended":  # the decode left while we computed
                self.rank.scheduler.finish(self.seq, "abort", "the decode side is gone")
                return self._failed(value, bootstrap=False)
            events.append(value)
            if isinstance(value, Finished):
                break
        if events[-1].reason != "length":  # aborted while computing
            pd.rooms.fail(room, TransferFailed("the request was aborted on the prefill engine", "aborted"))
            for ev in events:
                self.out.put_nowait(ev)
            return

        self.phase = "transfer"
        tokens = [ev for ev in events if isinstance(ev, int)]
        n = self.seq.prompt_len
        room.payload.set_result(KvPayload(n, n * self.cfg.kv_bytes_per_token, tokens[0] if tokens else None))
        t1 = asyncio.get_running_loop().time()
        name, value = await first({"ended": room.outcome, "aborted": self.aborted}, timeout=self.cfg.waiting_timeout)
        if name == "ended" and value is None:
            for ev in events:
                self.out.put_nowait(ev)
            return
        if name == "aborted":
            pd.rooms.fail(room, TransferFailed("the request was aborted on the prefill engine", "aborted"))
            self.out.put_nowait(Finished("abort", value))
            return
        if name is None:
            value = TransferFailed(timed_out(room_id, self.elapsed(t1), "Transferring"), "transfer_timeout")
            pd.rooms.fail(room, value)
        self._failed(value, bootstrap=False)

    def _failed(self, failure: TransferFailed, bootstrap: bool) -> None:
        if bootstrap:
            self.pd.stats.bootstrap_failed += 1
            message = prefill_bootstrap_failed(self.rid, self.req.key, failure.reason)
        else:
            self.pd.stats.transfer_failed += 1
            message = prefill_transfer_failed(self.rid, self.req.key, failure.reason)
        log.warning("%s", message)
        self.fail(message)


class VllmProducerSession(PdSession):
    role = "prefill"

    async def run(self) -> None:
        pd, transfer_id = self.pd, self.req.key
        try:
            room = pd.rooms.open((self.rank.dp_rank, transfer_id))
        except TransferFailed as failure:  # the decode gave up already; vLLM computes (and drops the KV)
            log.info("transfer %s: %s", transfer_id, failure.reason)
            room = None
        self.add_to_scheduler()
        fin = await self.forward()
        if room is None:
            return
        if fin.reason == "length":  # vLLM sends the KV of length-capped requests only
            n = self.seq.prompt_len
            room.payload.set_result(KvPayload(n, n * self.cfg.kv_bytes_per_token))
            pd.rooms.fail_after(room, self.cfg.abort_request_timeout, TransferFailed(
                f"the decode did not pull the KV of transfer {transfer_id} within VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT="
                f"{self.cfg.abort_request_timeout:g}s: its blocks were freed", "expired"))
        else:
            pd.rooms.fail(room, TransferFailed(f"the prefill request finished with {fin.reason!r}, not length-capped: "
                                               "its KV is not sent", "not_sent"))


class DecodeSession(PdSession):
    role = "decode"

    async def run(self) -> None:
        t0 = asyncio.get_running_loop().time()
        try:
            name, payload = await first({"pull": self._pull(t0), "aborted": self.aborted})
        except TransferFailed as failure:
            return await self._failed(failure)
        if name == "aborted" or self.seq.state == FINISHED:
            await self.forward()
            return
        self.pd.stats.transfers_received += 1
        n = self.seq.prompt_len
        if self.req.protocol == "sglang":
            self.seq.preloaded = n
            if payload.first_token is not None:
                self.seq.next_token = FirstThen(payload.first_token, self.seq.next_token)
        else:
            self.seq.preloaded = n - 1  # vLLM recomputes the last prompt token to sample the first
        if self.add_to_scheduler():
            await self.forward()

    async def _pull(self, t0: float) -> KvPayload:
        pd = self.pd
        assert pd.client is not None and pd.directory is not None
        url, rank = await pd.directory.locate(self.req)

        def connected() -> None:
            self.phase = "transfer"

        def got(n: int) -> None:
            pd.stats.bytes_received += n

        try:
            return await pull(pd.client, url, rank, self.req, self.seq.prompt_len, self.rid, started=t0,
                              wait=self.cfg.decode_wait, on_connected=connected, on_bytes=got)
        except TransferFailed as failure:
            if failure.kind in ("unreachable", "refused"):
                pd.directory.forget(url)  # a restarted prefill may answer differently: ask it again next time
            raise

    async def _failed(self, failure: TransferFailed) -> None:
        self.pd.stats.failed("decode", failure.kind)
        if failure.kind in _BOOTSTRAP_KINDS:
            self.pd.stats.bootstrap_failed += 1
        else:
            self.pd.stats.transfer_failed += 1
        if self.req.protocol == "vllm" and self.cfg.kv_load_failure_policy == "recompute":
            log.warning("transfer %s failed (%s): recomputing the prompt (kv_load_failure_policy=recompute)",
                        self.req.key, failure.reason)
            if self.add_to_scheduler():
                await self.forward()
            return
        if self.req.protocol == "sglang":
            message = decode_failed(self.rid, self.req.key, failure.reason)
            log.warning("%s", message)
        else:
            message = VLLM_ERROR
            log.warning("request %s: KV load of transfer %s failed: %s", self.rid, self.req.key, failure.reason)
        self.fail(message)
