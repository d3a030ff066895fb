"""The prefill/decode pairs in flight, and what to do when one leg ends. Pure: no I/O, no clock.

A disaggregated request runs as two legs, each with its own lease: the prefill leg (whose answer
the router drains) and the decode leg (whose answer the client reads). The rules:

- If either leg fails, or the client goes away (the decode leg ends ``cancelled``), the other leg
  is cancelled when it may still run, and every lease of the pair is released: no orphaned room
  waits out its bootstrap timeout, no load stays counted.
- Prefill's load (its lease) is held until the decode leg ends (guard release ``hold``, default);
  with ``completion`` it is released as soon as the prefill answer has been drained completely.
  Response headers alone never release it; a failed or cancelled prefill releases it at once.
- The decode lease is released by its own Release, as for any request.

``PdPairs`` returns ``Action`` lists; the adapter executes them (release a lease, cancel a leg).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

GuardRelease = Literal["hold", "completion"]
GUARD_RELEASES: tuple[str, ...] = ("hold", "completion")


@dataclass(slots=True, frozen=True)
class Action:
    kind: Literal["release", "cancel"]
    lease_id: str  # the leg's lease (release: drop it; cancel: the leg to stop)
    worker_id: str
    request_id: str
    outcome: str | None = None  # release: how the leg ended, when known ("error" invalidates its session pin)
    why: str = ""  # cancel: set when the leg is stopped because the other one failed (the client sees it)
    status: int = 502  # cancel with ``why``: the status the client gets (the other leg's own 4xx, or 502)
    failed_worker: str = ""  # cancel with ``why``: the worker of the leg that failed (a retry avoids it)


@dataclass(slots=True)
class Leg:
    lease_id: str
    worker_id: str
    ended: bool = False  # its Release arrived, or the router saw it fail or complete
    released: bool = False  # its lease was released


@dataclass(slots=True)
class Pair:
    request_id: str
    prefill: Leg
    decode: Leg | None = None  # None until the decode leg is handed to its worker
    legs: list[Leg] = field(default_factory=list)


class PdPairs:
    def __init__(self, guard: GuardRelease = "hold") -> None:
        if guard not in GUARD_RELEASES:
            raise ValueError(f"pd prefill guard release must be one of {', '.join(GUARD_RELEASES)}, got {guard!r}")
        self.guard = guard
        self._by_lease: dict[str, Pair] = {}

    # --- building a pair ----------------------------------------------------------------
    def start(self, request_id: str, prefill_lease: str, prefill_worker: str) -> Pair:
        pair = Pair(request_id, Leg(prefill_lease, prefill_worker))
        self._by_lease[prefill_lease] = pair
        return pair

    def add_decode(self, prefill_lease: str, decode_lease: str, decode_worker: str, request_id: str) -> list[Action]:
        """The decode leg was handed to its worker. If the prefill already failed, stop it again."""
        pair = self._by_lease.get(prefill_lease)
        if pair is None:  # the pair is gone: the prefill failed meanwhile and everything was released
            return [Action("cancel", decode_lease, decode_worker, request_id),
                    Action("release", decode_lease, decode_worker, request_id)]
        pair.decode = Leg(decode_lease, decode_worker)
        self._by_lease[decode_lease] = pair
        return []

    def abandon(self, prefill_lease: str) -> list[Action]:
        """No decode leg could be placed: stop the prefill leg and release it."""
        pair = self._by_lease.get(prefill_lease)
        if pair is None:
            return []
        actions = self._stop(pair, pair.prefill)
        self._forget(pair)
        return actions

    # --- events ----------------------------------------------------------------------------
    def prefill_drained(self, lease_id: str, ok: bool, status: int | None = None, message: str = "") -> list[Action]:
        """The router read the prefill leg's last frame: its answer is complete (``ok``) or an error
        (``status``, ``message``). A client error (4xx but 429: the prompt too long, say) is the
        request's fault, not the worker's: the leg is released ``ok`` (its breaker untouched) and the
        decode leg is stopped with that status and message, which the client then gets as its answer."""
        pair = self._by_lease.get(lease_id)
        if pair is None or pair.prefill.lease_id != lease_id or pair.prefill.ended:
            return []
        pair.prefill.ended = True
        if not ok:
            if status is not None and 400 <= status < 500 and status != 429:
                return self._fail(pair, failed=pair.prefill, outcome="ok", status=status, why=message)
            return self._fail(pair, failed=pair.prefill, outcome="error", detail=message)
        if self.guard == "completion":
            return self._release(pair, pair.prefill)
        return []

    def released(self, lease_id: str, outcome: str) -> list[Action]:
        """A worker-agent's Release for one leg (``outcome`` ok, error, cancelled or expired)."""
        pair = self._by_lease.get(lease_id)
        if pair is None:
            return []
        if lease_id == pair.prefill.lease_id:
            leg = pair.prefill
            already = leg.ended
            leg.ended = True
            if outcome != "ok":
                return self._fail(pair, failed=leg, outcome=outcome)
            if self.guard == "completion" or already and pair.decode is not None and pair.decode.ended:
                return self._release(pair, leg)
            return []
        # the decode leg ended, whatever its outcome: the pair is over
        assert pair.decode is not None
        pair.decode.ended = True
        actions = self._release(pair, pair.decode, outcome)
        if not pair.prefill.ended:
            actions += self._stop(pair, pair.prefill)
        else:
            actions += self._release(pair, pair.prefill)
        self._forget(pair)
        return actions

    def worker_left(self, worker_id: str, dropped_leases: list[str]) -> list[Action]:
        """A worker left discovery and its leases were dropped: stop and release the other legs,
        unless the leg that left is a prefill that had already answered (its KV handed over): the
        decode goes on without it (a stream already decoding was cut for a prefill engine's death)."""
        actions: list[Action] = []
        for lease_id in dropped_leases:
            pair = self._by_lease.get(lease_id)
            if pair is None:
                continue
            answered = pair.prefill.lease_id == lease_id and pair.prefill.ended
            gone = pair.prefill if pair.prefill.lease_id == lease_id else pair.decode
            if gone is not None:
                gone.ended = gone.released = True
            if answered and pair.decode is not None and not pair.decode.ended:
                self._by_lease.pop(lease_id, None)  # the pair ends with its decode leg
                continue
            actions += self._fail(pair, failed=gone, detail="its worker left")
        return actions

    # --- queries ---------------------------------------------------------------------------
    def pair_of(self, lease_id: str) -> Pair | None:
        return self._by_lease.get(lease_id)

    def is_leg(self, lease_id: str) -> bool:
        return lease_id in self._by_lease

    def __len__(self) -> int:
        return len({id(p) for p in self._by_lease.values()})

    # --- internals ---------------------------------------------------------------------------
    def _fail(self, pair: Pair, failed: Leg | None, outcome: str | None = None, *, status: int = 502,
              why: str = "", detail: str = "") -> list[Action]:
        """One leg failed (or its worker left): stop every other leg still running, release all. The
        client hears ``why`` with ``status`` when given, else a 502 naming the failed leg's worker
        (and ``detail``, what it said)."""
        actions: list[Action] = []
        for leg in (pair.prefill, pair.decode):
            if leg is None:
                continue
            if leg is not failed and not leg.ended:
                other = "prefill" if leg is pair.decode else "decode"
                if not why:
                    on = f" on worker {failed.worker_id}" if failed is not None else ""
                    why = f"the {other} leg of this disaggregated request failed{on}"
                    why += f": {detail}" if detail else ""
                actions += self._stop(pair, leg, why, status, failed.worker_id if failed is not None else "")
            else:
                actions += self._release(pair, leg, outcome if leg is failed else None)
        self._forget(pair)
        return actions

    def _stop(self, pair: Pair, leg: Leg, why: str = "", status: int = 502, failed_worker: str = "") -> list[Action]:
        leg.ended = True
        return [Action("cancel", leg.lease_id, leg.worker_id, pair.request_id, why=why, status=status,
                       failed_worker=failed_worker),
                *self._release(pair, leg)]

    @staticmethod
    def _release(pair: Pair, leg: Leg, outcome: str | None = None) -> list[Action]:
        if leg.released:
            return []
        leg.released = True
        return [Action("release", leg.lease_id, leg.worker_id, pair.request_id, outcome)]

    def _forget(self, pair: Pair) -> None:
        for leg in (pair.prefill, pair.decode):
            if leg is not None:
                self._by_lease.pop(leg.lease_id, None)
