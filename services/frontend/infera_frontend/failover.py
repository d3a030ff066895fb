"""Which failed attempts of a request are tried again on another worker. Pure, no I/O.

A request is retried only while the client has received nothing from it (no status line, no byte,
no NATS reply), and only for failures another worker may not have:

- an ``error`` frame from the worker-agent with status 502 (engine unreachable, connection lost or
  timed out, engine exited), 503 (worker draining, stopping, or its engine gone) or 504 (deadline
  passed before or while the engine answered): reason ``worker_<status>``; one whose engine refused
  the connection (``Frame.unreached``: nothing of the request ran anywhere) is reason
  ``worker_unreachable`` and does not spend ``--request-max-retries``: up to ``UNREACHED_RETRIES``
  such attempts are tried again besides (a mass loss of workers: each retry may meet another engine
  that is gone but still listed until its discovery entry ages out);
- an engine answer (a ``head``) with status 429 (engine overloaded), 502, 503 or 504: reason
  ``engine_<status>``;
- no frame within ``--upstream-timeout`` before the first token: reason ``upstream_timeout`` (the
  worker has been sent a ``Cancel`` marked ``worker_fault``, so its lease counts as an error in its
  router's circuit breaker);
- NATS "no responders" for the route request (no router subscribed) until ``--route-timeout``
  (the relay sends it again every 0.25 s meanwhile): reason ``no_router``; nobody received the
  request, so it cannot run twice;
- no route reply within ``--route-timeout`` (a router stalled or frozen while still subscribed: the
  broker hands it its share of the route requests): reason ``route_timeout``, through the routers'
  queue group again. It cannot run twice either: the request carries its ``route_deadline``, and a
  router that gets to it later drops it unplaced (an older router without that check could still
  place it: the engine then answers nobody);
- response frames lost between the worker and the frontend (e.g. across a broker restart) that the
  worker could not send again, or a request its worker never received: reason ``frames_lost``
  (the worker has been sent a ``Cancel``);
- the process sending the request's frames (its worker-agent, or the router running it on
  ``--request-transport http``) left the message bus: reason ``sender_gone`` (``sender_watch.py``).

Never retried: any other 4xx (the client's request is at fault; 499 is the requester's own cancel,
409 a duplicate request id), 500 (agent or engine bug), unreadable frames, a router refusal (the
router already chose among every worker of the model), and anything after the first data frame.
"""

from __future__ import annotations

from infera_frontend.validation import ApiError

#: Statuses that say "this worker cannot answer now", not "this request is wrong".
RETRYABLE_WORKER_STATUSES = frozenset({502, 503, 504})
RETRYABLE_ENGINE_STATUSES = frozenset({429, 502, 503, 504})

UPSTREAM_TIMEOUT = "upstream_timeout"
UNREACHABLE = "worker_unreachable"  # the engine refused the connection: the request never ran
#: Attempts of one request whose engine was never reached that are tried again on other workers,
#: besides --request-max-retries (they cost no engine work; the router's breaker takes the worker out).
UNREACHED_RETRIES = 3
NO_ROUTER = "no_router"
ROUTE_TIMEOUT = "route_timeout"  # no route reply within --route-timeout (the router drops it after)
FRAMES_LOST = "frames_lost"
SENDER_GONE = "sender_gone"  # the process sending the request's frames left the bus (sender_watch.py)
CLIENT_TOO_SLOW = "client_too_slow"  # its frames piled up unread (--max-unread-frames): cancelled, never retried


class RetryableError(ApiError):
    """A failure that another attempt on another worker may not meet; ``reason`` labels it.
    ``failed_worker`` names the worker at fault when it is not the one the attempt was placed on
    (the prefill worker of a disaggregated pair, whose failure stopped the decode leg)."""

    def __init__(self, status: int, message: str, *, reason: str, failed_worker: str = "", **kw) -> None:
        super().__init__(status, message, **kw)
        self.reason = reason
        self.failed_worker = failed_worker


def worker_error_reason(status: int, unreached: bool = False) -> str | None:
    """The retry reason of a worker-agent ``error`` frame, or None when it is final."""
    if status not in RETRYABLE_WORKER_STATUSES:
        return None
    return UNREACHABLE if unreached else f"worker_{status}"


def engine_status_reason(status: int) -> str | None:
    """The retry reason of an engine's answer with ``status``, or None when it is final."""
    return f"engine_{status}" if status in RETRYABLE_ENGINE_STATUSES else None


def retry_reason(err: ApiError) -> str | None:
    return err.reason if isinstance(err, RetryableError) else None


class Attempts:
    """The attempts of one request: the workers tried, and whether one more attempt may follow."""

    __slots__ = ("max_retries", "retries", "tried", "unreached")

    def __init__(self, max_retries: int) -> None:
        self.max_retries = max_retries
        self.retries = 0
        self.unreached = 0  # retries of attempts whose engine was never reached (their own budget)
        self.tried: list[str] = []

    def tried_on(self, worker_id: str) -> None:
        if worker_id not in self.tried:
            self.tried.append(worker_id)

    def failed_elsewhere(self, worker_id: str, failed_worker: str) -> None:
        """The attempt on ``worker_id`` failed for ``failed_worker``'s fault (a disaggregated pair's
        prefill): the retry avoids that worker, and may go to ``worker_id`` again."""
        if failed_worker and failed_worker != worker_id:
            if worker_id in self.tried:
                self.tried.remove(worker_id)
            self.tried_on(failed_worker)

    def retry(self, reason: str | None) -> bool:
        """True (and one retry spent) when a failure with ``reason`` gets another attempt."""
        if reason == UNREACHABLE and self.unreached < UNREACHED_RETRIES:
            self.unreached += 1
            return True
        if reason is None or self.retries >= self.max_retries:
            return False
        self.retries += 1
        return True
