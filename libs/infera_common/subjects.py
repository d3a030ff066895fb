"""Every NATS subject, stream, consumer and bucket name Infera uses.

Nothing else in the project spells a subject: import the names from here.
Worker ids are used as subject tokens, so they must match ``TOKEN_RE``.
"""

from __future__ import annotations

import re

PREFIX = "infera"

#: A subject token: no dots, spaces or wildcards.
TOKEN_RE = re.compile(r"^[A-Za-z0-9_-]{1,128}$")

# --- discovery plane (NATS) -------------------------------------------------
#: JetStream KV bucket holding one key per worker (the key is the worker id).
DISCOVERY_BUCKET = "infera_workers"
#: etcd discovery: every worker's key is this prefix + its worker id (the record as JSON).
ETCD_WORKERS_PREFIX = "/infera/workers/"

# --- request plane (NATS) ---------------------------------------------------
def work_subject(worker_id: str) -> str:
    """Subject a worker-agent consumes its requests from."""
    return f"{PREFIX}.work.{_token(worker_id)}"


def work_consumer(worker_id: str) -> str:
    """Durable consumer name of a worker-agent on the request stream."""
    return f"agent-{_token(worker_id)}"


def cancel_subject(worker_id: str) -> str:
    """Core-NATS subject on which a worker's in-flight requests are cancelled."""
    return f"{PREFIX}.cancel.{_token(worker_id)}"


#: Every worker's cancel subject: what a router that calls engines over HTTP listens to.
CANCEL_SUBJECTS = f"{PREFIX}.cancel.*"


def worker_of_cancel_subject(subject: str) -> str | None:
    """The worker id a ``cancel_subject`` names; None for any other subject."""
    head, _, worker_id = subject.rpartition(".")
    return worker_id if head == f"{PREFIX}.cancel" and TOKEN_RE.match(worker_id) else None


def frames_query_subject(worker_id: str) -> str:
    """Request/reply: how many response frames each of some requests has sent (``FramesQuery``),
    asked by a frontend that lost its connection to the broker; the worker-agent answers."""
    return f"{PREFIX}.frames.query.{_token(worker_id)}"


def frames_replay_subject(worker_id: str) -> str:
    """Request/reply: send a request's frames again from a number on (``FramesReplay``), asked by a
    frontend that missed some; the worker-agent answers how many it sent (``FramesReplayed``)."""
    return f"{PREFIX}.frames.replay.{_token(worker_id)}"


# --- load reports -------------------------------------------------------------
LOAD_SUBJECTS = f"{PREFIX}.load.*"


def load_subject(worker_id: str) -> str:
    """Core-NATS subject a worker-agent publishes its periodic load report on."""
    return f"{PREFIX}.load.{_token(worker_id)}"


# --- router RPC ----------------------------------------------------------------
#: Request/reply: pick a worker for a request (queue group ``ROUTER_QUEUE``).
ROUTER_ROUTE = f"{PREFIX}.router.route"
ROUTER_QUEUE = "infera-router"
#: Request/reply, every router (no queue group): each answers with its router id. A frontend whose
#: route request went unanswered asks it, and sends the retry to the first router that answers
#: (``router_route_subject``), not to the queue group, which may hand it to the same silent router.
ROUTER_PING = f"{PREFIX}.router.ping"


def router_route_subject(router_id: str) -> str:
    """Route requests for one router instance alone (the same RPC as ``ROUTER_ROUTE``)."""
    return f"{PREFIX}.router.route.{_token(router_id)}"


def router_release_subject(router_id: str) -> str:
    """Subject on which the router instance that issued a lease takes it back."""
    return f"{PREFIX}.router.release.{_token(router_id)}"


def router_pd_subject(router_id: str, lease_id: str) -> str:
    """Where the prefill leg of a disaggregated request streams its answer, for its router to drain."""
    return f"{PREFIX}.router.pd.{_token(router_id)}.{_token(lease_id)}"


def router_pd_subjects(router_id: str) -> str:
    """Every prefill leg answer of one router instance (wildcard of ``router_pd_subject``)."""
    return f"{PREFIX}.router.pd.{_token(router_id)}.*"


def router_frames_query_subject(router_id: str) -> str:
    """``frames_query_subject`` for the requests a router runs on engines itself (``--request-transport
    http``): the router instance that sends their frames answers."""
    return f"{PREFIX}.router.frames.query.{_token(router_id)}"


def router_frames_replay_subject(router_id: str) -> str:
    """``frames_replay_subject`` for the requests a router runs on engines itself."""
    return f"{PREFIX}.router.frames.replay.{_token(router_id)}"


def router_prefilled_subject(router_id: str) -> str:
    """Subject on which the router that issued a lease hears that its request's prefill is done."""
    return f"{PREFIX}.router.prefilled.{_token(router_id)}"


# --- replies -------------------------------------------------------------------
#: NATS's reply-subject prefix (the clients' own, nats-py's ``_INBOX``).
INBOX_PREFIX = "_INBOX"


def frontend_inbox_prefix(frontend_id: str) -> str:
    """Every reply subject of one frontend starts so (``<prefix><n>``; one wildcard subscription)."""
    return f"{INBOX_PREFIX}.{_token(frontend_id)}."


#: The last token of the subject on which a frontend answers that it is on the bus (``<prefix>alive``:
#: its inbox subscription's wildcard takes it; its reply subjects end in numbers).
ALIVE_TOKEN = "alive"


def requester_alive_subject(reply_subject: str) -> str | None:
    """Where to ask whether the frontend behind ``reply_subject`` is still on the bus: NATS answers
    "no responders" there once it is not (a frontend that predates the question takes it and says
    nothing). None for a reply subject that is not a frontend's (a router's prefill leg)."""
    parts = reply_subject.split(".")
    if len(parts) != 3 or parts[0] != INBOX_PREFIX:
        return None
    return f"{parts[0]}.{parts[1]}.{ALIVE_TOKEN}"


# --- frontend API for NATS clients -------------------------------------------
FRONTEND_QUEUE = "infera-frontend"
#: Every API subject starts so (a request whose reply subject does is refused: it would call the API).
API_PREFIX = f"{PREFIX}.api."
API_CHAT_COMPLETIONS = f"{PREFIX}.api.v1.chat.completions"
API_COMPLETIONS = f"{PREFIX}.api.v1.completions"
API_MODELS = f"{PREFIX}.api.v1.models"
API_WORKERS = f"{PREFIX}.api.v1.workers"

# --- KV events and the prefix index -------------------------------------------
#: JetStream stream holding every worker's relayed engine KV events (bounded, for replay).
KV_EVENT_STREAM = "INFERA_KV_EVENTS"
KV_EVENT_SUBJECTS = f"{PREFIX}.kv.events.>"
#: Request/reply: overlap of a request's block hashes with each worker's cached prefix.
KV_QUERY = f"{PREFIX}.kv.query"
#: kv-indexer (or a router's local index) -> every worker-agent: put your whole holding on the stream
#: (``KvResync``; the agents answer with ``KvRelay(kind="state")`` on their event subjects).
KV_RESYNC = f"{PREFIX}.kv.resync"
KV_INDEXER_QUEUE = "infera-kv-indexer"
#: Request/reply, every kv-indexer (no queue group): each answers with its id (``answering``): after
#: a query went unanswered, a router asks the first to answer (``kv_query_subject``) for a while.
KV_PING = f"{PREFIX}.kv.ping"


def kv_query_subject(indexer_id: str) -> str:
    """Overlap queries for one kv-indexer instance alone (the same RPC as ``KV_QUERY``)."""
    return f"{PREFIX}.kv.query.{_token(indexer_id)}"


def kv_event_subject(worker_id: str) -> str:
    """Subject a worker-agent relays its engine's KV event batches to."""
    return f"{PREFIX}.kv.events.{_token(worker_id)}"


def _token(value: str) -> str:
    if not TOKEN_RE.match(value):
        raise ValueError(f"{value!r} is not a valid subject token (allowed: letters, digits, '_', '-')")
    return value


def request_stream(worker_id: str) -> str:
    """Name of the work-queue stream holding one worker's pending requests.

    One stream per worker, so the broker itself enforces that worker's pending limit
    (``max_msgs`` with discard-new) atomically for every router that publishes to it.
    """
    return f"INFERA_REQ_{_token(worker_id)}"
