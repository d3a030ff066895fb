"""Typed messages that cross a service boundary (their msgpack encoding is ``codec``'s, re-exported here).

Every message on the bus is one of these models, msgpack-encoded with ``encode`` and read
back with ``decode``. Request bodies travel as the client's raw JSON bytes so that no hop
re-serialises them.
"""

from __future__ import annotations

import time
from array import array
from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from infera_common.block_hash import unpack_tokens
from infera_common.codec import M, decode, encode, encode_sparse  # noqa: F401 - re-exported: the messages' codec
from infera_common.subjects import TOKEN_RE

EngineKind = Literal["sglang", "vllm", "mock"]
#: Seconds after its last heartbeat that a worker's discovery entry ages out, unless --discovery-ttl says.
DISCOVERY_TTL = 6.0

DiscoveryBackend = Literal["nats", "etcd"]
RequestTransport = Literal["nats", "http"]
KvEventTransport = Literal["nats", "zmq"]


class Role(StrEnum):
    AGGREGATED = "aggregated"
    PREFILL = "prefill"
    DECODE = "decode"


class WorkerStatus(StrEnum):
    """Only ``active`` workers are sent requests."""

    STARTING = "starting"
    ACTIVE = "active"
    DRAINING = "draining"
    UNHEALTHY = "unhealthy"  # the engine's process runs but it fails its health probes


class Endpoint(StrEnum):
    """The engine HTTP endpoints a request can be addressed to."""

    CHAT = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"


class _Msg(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=False)


class PdParams(_Msg):
    """Prefill/decode transfer parameters of a disaggregated worker (issue 4)."""

    protocol: Literal["sglang-bootstrap", "vllm-mooncake"]
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    engine_id: str | None = None


class WorkerRecord(_Msg):
    """What discovery holds for one worker (one engine behind one worker-agent)."""

    worker_id: str = Field(pattern=TOKEN_RE.pattern)
    model: str  # the served model name clients ask for (the engine's first /v1/models entry)
    #: the engine's other served names, which clients may ask for as well (vLLM's ``--served-model-name
    #: a b``: /v1/models entries without a ``parent``; LoRA adapters, which have one, are not among them)
    aliases: list[str] = Field(default_factory=list)
    #: the LoRA adapters the engine serves, which clients may ask for too (its /v1/models entries that
    #: name a ``parent``: vLLM's ``--lora-modules``, SGLang's ``--lora-paths``); the KV blocks an
    #: adapter computes chain from its own root (``block_hash.adapter_root``), apart from the model's
    adapters: list[str] = Field(default_factory=list)
    #: how the engine takes a request for one of its adapters: by its name (vLLM: ``"model": "sql"``)
    #: or after its served name (SGLang: ``"model": "<model>:sql"``; a bare adapter name there is not an
    #: adapter, and SGLang would run the base model): see ``engine_model``
    adapter_naming: Literal["name", "model:name"] = "name"
    engine: EngineKind
    role: Role = Role.AGGREGATED
    url: str  # the engine's HTTP base URL, e.g. http://10.0.0.5:30000
    advertise_host: str
    discovery_backend: DiscoveryBackend = "nats"
    request_transport: RequestTransport = "nats"
    kv_event_transport: KvEventTransport = "nats"
    dp_size: int = 1
    dp_rank: int | None = None
    kv_block_size: int | None = None  # the engine's resolved page size
    #: the size its KV events are indexed at, which the router hashes requests at: a multiple of
    #: ``kv_block_size`` its pages are folded into (None: ``kv_block_size`` itself); see ``index_block_size``
    kv_index_block_size: int | None = None
    #: the KV cache of each DP rank, in tokens (None: the engine did not say); with the index's
    #: blocks held there, how full it is: what placing a new prompt there evicts (policy_kv_aware)
    kv_capacity_tokens: int | None = None
    kv_events_endpoints: list[str] = Field(default_factory=list)  # the engine's ZMQ PUB per DP rank, advertised
    #: the replay ROUTER endpoint of each ``kv_events_endpoints`` entry, same order ('' where there is none)
    kv_replay_endpoints: list[str] = Field(default_factory=list)
    #: on ``--kv-event-transport zmq``: where the agent serves every rank's whole holding (GET; a
    #: msgpack array of encoded ``KvRelay(kind="state")``), which an index reads before the engine's
    #: replay when it starts following the worker (None: an older agent, or another transport)
    kv_state_url: str | None = None
    pd: PdParams | None = None
    #: its agent takes the engine out of routing when it hangs with requests (health probes that
    #: generate, or the stall check): a router calling the engine itself (``--request-transport
    #: http``) then sends ``alive`` frames for the requests waiting there (False: an older agent)
    finds_hangs: bool = False
    #: its engine asks each request for an API key (its --api-key): a router that calls it itself
    #: (--request-transport http) needs that key as its --engine-api-key (the key is never in the record)
    engine_api_key: bool = False
    #: the longest sequence (prompt + output tokens) the engine accepts, from its ``/v1/models``
    #: ``max_model_len``: a frontend refuses longer requests itself, in the OpenAI error format
    #: (None: not said, an older agent, or an engine that truncates long prompts instead)
    context_length: int | None = None
    #: the engine lowers a request's ``max_tokens`` to what its context leaves after the prompt (vLLM)
    #: where SGLang refuses the request: a frontend then refuses only ``max_tokens`` past ``context_length``
    clamps_max_tokens: bool = False
    status: WorkerStatus = WorkerStatus.STARTING
    max_pending: int = 0  # broker-enforced pending limit (0 = unknown)
    version: str = ""
    started_at: float = Field(default_factory=time.time)
    ttl: float = DISCOVERY_TTL  # seconds without a heartbeat after which watchers drop this worker
    heartbeat_at: float = Field(default_factory=time.time)  # wall clock of the last heartbeat

    @property
    def served_names(self) -> list[str]:
        """Every name a request may give to be served by this worker: ``model`` first, then the
        aliases, then the adapters."""
        return list(dict.fromkeys([self.model, *self.aliases, *self.adapters]))

    def adapter(self, name: str) -> str | None:
        """The LoRA adapter a request for ``name`` runs under here (None: the model itself, by one of
        its names)."""
        if name in self.adapters and name != self.model and name not in self.aliases:
            return name
        return None

    def answer_model(self, name: str) -> tuple[str, str] | None:
        """``WorkEnvelope.answer_model`` for a request naming ``name``: (the engine's name, ``name``)
        when the engine is sent a name of its own."""
        named = self.engine_model(name)
        return None if named is None else (named, name)

    def engine_model(self, name: str) -> str | None:
        """The ``model`` this worker's engine must be sent for a request naming ``name`` (None: ``name``
        as it is): an adapter after the served name, for an engine that names adapters so."""
        if self.adapter_naming == "model:name" and self.adapter(name) is not None:
            return f"{self.model}:{name}"
        return None

    @property
    def index_block_size(self) -> int | None:
        """Tokens per block of this worker's KV index entries: what a router hashes a request at."""
        return self.kv_index_block_size or self.kv_block_size


class LoadReport(_Msg):
    """Periodic load report of a worker-agent."""

    worker_id: str
    in_flight: int  # requests the agent has handed to the engine and not finished
    engine_running: int = 0
    engine_waiting: int = 0
    kv_usage: float = 0.0  # fraction of the engine's KV cache in use, 0..1
    ts: float = Field(default_factory=time.time)
    #: ``in_flight`` split by the router that leased each request: a router counts the others'
    #: requests from this without guessing which of its own the report still includes
    by_router: dict[str, int] = Field(default_factory=dict)
    #: the size of those requests, per router whose every request here said it (``WorkEnvelope.prefill_tokens``):
    #: (prompt tokens still to prefill, prompt tokens x samples of the requests past their first streamed
    #: token), as the leasing router counts its own; a router weighs the others' requests by them
    #: instead of sizing each like the request it is placing (``None``: not said, an older agent)
    by_router_work: dict[str, tuple[int, int]] | None = None
    #: requests the engine holds that did not come through this agent (clients calling the engine
    #: directly): its running + waiting less the agent's in-flight count taken both before and
    #: after reading them, so a request that ended or started during the read is not counted
    #: (``None``: not said, an older agent; a router then subtracts ``in_flight`` itself)
    engine_unseen: int | None = None
    #: the sequences the engine runs for ``in_flight`` (``n`` samples x prompts each; ``None``: not
    #: said, an older agent): what a least-loaded router compares with its own leases' sequences
    in_flight_sequences: int | None = None
    #: the served model and where the worker is registered: a service whose discovery does not list
    #: a worker that reports load can then say which plane it is on (``None``: not said)
    model: str = ""
    discovery_backend: DiscoveryBackend | None = None
    etcd_endpoint: str = ""  # with discovery_backend etcd: the --etcd-endpoint the worker registered at
    #: seconds between this worker's reports (its --load-interval; a slow engine scrape adds up to as
    #: much again; ``None``: not said, an older agent): a router asks a worker whose report is
    #: overdue whether its agent is still on the bus (router ``off_bus.py``)
    report_every: float | None = None


#: The header a client sends its session id in, to opt in to session affinity (HTTP, or a NATS
#: message header on the NATS API; names compare without case). Its values travel as
#: ``RouteRequest.session_ids``.
SESSION_HEADER = "X-Dynamo-Session-ID"


class RouteRequest(_Msg):
    """Frontend -> router: route this request and hand it to the chosen worker."""

    request_id: str
    model: str
    endpoint: Endpoint
    body: bytes  # the OpenAI request body as JSON bytes, forwarded verbatim
    stream: bool = False
    reply_subject: str  # where the worker streams response frames
    prompt_tokens: int = 0
    #: the prompt's token ids for routing, packed by ``block_hash.pack_tokens`` (``None``: the frontend
    #: could not reproduce the engine's ids). Bytes, not a list: as a list, a 16k-token prompt cost
    #: ~0.5 ms of validation on each side of the bus. Read them as ``token_ids``.
    tokens: bytes | None = None
    #: the body's ``cache_salt`` (vLLM, SGLang: a prefix cache of its own, which only requests with
    #: the same salt reuse), for the router to hash the prompt as the engine will; see ``validation.cache_salt``
    cache_salt: str | None = None
    deadline: float  # unix time after which nobody waits for the answer
    #: unix time after which the requester no longer waits for the route reply (its --route-timeout;
    #: it tries another router then): a router that gets to the request later (it was stalled, or
    #: its backlog grew) drops it instead of placing work whose answer nobody reads (``None``: not said)
    route_deadline: float | None = None
    exclude: list[str] = Field(default_factory=list)  # worker ids not to pick (retries)
    #: every value of the client's X-Dynamo-Session-ID header, in order, unmodified (empty: no header);
    #: the router validates them (duplicates, empty, too long -> 400) when its affinity mode is on
    session_ids: list[str] = Field(default_factory=list)
    #: the frontend's discovery backend: a router watching another one refuses (503) rather than
    #: route on a different fleet (``None``: not said, no check)
    discovery_backend: DiscoveryBackend | None = None
    #: the W3C trace context of the frontend's span (``tracing``; ``None``: no trace)
    traceparent: str | None = None
    #: the sequences the engine will run for it: ``n`` samples of each prompt of a completions batch
    sequences: int = Field(1, ge=1)
    #: ``n``, the samples of each prompt: each decodes over its prompt's context, so a request's
    #: decode load is ``prompt_tokens`` x ``samples`` (its prefill, shared by the samples, is not)
    samples: int = Field(1, ge=1)
    #: seconds: while the engine holds the request and the requester has had no data frame (nor the
    #: final answer), the worker sends an ``alive`` frame whenever it has sent nothing for this long
    #: (``None``: never, as before; the router copies it into the ``WorkEnvelope``)
    keepalive: float | None = Field(None, gt=0)
    #: seconds: the requester's ``--upstream-timeout``, the longest it waits for word from a worker
    #: (``None``: not said). A router that waits on a worker's answer before it can reply (the
    #: prefill leg of a sequential pair) waits no longer, sending ``alive`` frames meanwhile
    upstream_timeout: float | None = Field(None, gt=0)

    @field_validator("tokens")
    @classmethod
    def _whole_words(cls, v: bytes | None) -> bytes | None:
        if v is not None and len(v) % 4:
            raise ValueError(f"tokens must be whole 4-byte token ids, got {len(v)} bytes")
        return v

    @property
    def token_ids(self) -> array | None:
        """The prompt's token ids (a C array of unsigned 32-bit integers), or ``None``."""
        return None if self.tokens is None else unpack_tokens(self.tokens)

    @property
    def token_count(self) -> int:
        """How many token ids ``tokens`` holds (0 when none), without unpacking them."""
        return len(self.tokens) // 4 if self.tokens else 0


class RouteReply(_Msg):
    """Router -> frontend: where the request went, or why it went nowhere.

    ``status`` follows HTTP: 200 routed, 404 unknown model, 429 every candidate full,
    503 no active worker, 500 router failure.
    """

    status: int
    message: str = ""
    worker_id: str | None = None
    lease_id: str | None = None
    router_id: str | None = None
    # who sends the worker's frames and answers questions about them: its worker-agent, or (on
    # --request-transport http) this router, which calls the engine itself; None from a router that
    # predates the field (the frontend then asks the worker, and does not watch the sender)
    frames_from: Literal["worker", "router"] | None = None


class WorkEnvelope(_Msg):
    """Router -> worker-agent, on the worker's work-queue stream."""

    request_id: str
    endpoint: Endpoint
    body: bytes
    stream: bool = False
    reply_subject: str
    deadline: float  # unix time on the clock of the requester at ``clock_of`` (else ``reply_subject``)
    #: the requester whose wall clock ``deadline`` is on, when its frames go elsewhere (a prefill
    #: leg's go to its router; the deadline is its frontend's): read with the offset to that one
    clock_of: str = ""
    lease_id: str
    router_id: str
    headers: dict[str, str] = Field(default_factory=dict)  # extra HTTP headers for the engine (e.g. a DP rank)
    #: the sequences the engine runs for it (``RouteRequest.sequences``): each shows in its running
    #: count, so the worker-agent counts them, not requests, against the engine's figures
    sequences: int = Field(1, ge=1)
    #: ``RouteRequest.keepalive``: send ``alive`` frames while the answer has not begun
    keepalive: float | None = Field(None, gt=0)
    #: the request's size as its router counts it in its load (``None``: not said, an older router):
    #: the prompt tokens it found uncached on this worker, and the prompt tokens times ``n`` its
    #: decoding reads; the worker-agent reports them per router (``LoadReport.by_router_work``)
    prefill_tokens: int | None = None
    decode_tokens: int | None = None
    #: (the engine's name for the model, the name the fleet serves it by): set when the router wrote
    #: the engine's own name into ``body`` (SGLang's ``<model>:<adapter>``, ``WorkerRecord.engine_model``);
    #: the answer's ``model`` is given back the served name, as every engine answers it elsewhere
    answer_model: tuple[str, str] | None = None


FrameKind = Literal["head", "data", "end", "error", "alive"]


class Frame(_Msg):
    """Worker-agent -> requester: one piece of a response.

    ``head`` carries the engine's HTTP status (and, for a non-streaming answer, the whole body);
    ``data`` one SSE event payload (JSON bytes, without ``data: `` framing); ``end`` closes the
    response; ``error`` is an agent-side failure with an HTTP-like status and message.
    ``alive`` says the engine still holds the request (sent only to a requester that asked, by
    ``keepalive``, while nothing of the answer was sent): it carries no part of the response and
    no number of its own (its ``seq`` is the number the next frame will have).

    A non-streaming answer is ONE frame: ``head`` with ``final=True`` and the whole body (which
    may be empty); no ``end`` follows it. A stream is ``head`` (``final=False``), ``data``...,
    ``end``. ``end``, ``error`` and a final ``head`` each close the response.
    """

    kind: FrameKind
    seq: int = 0
    status: int = 200
    body: bytes = b""
    message: str = ""
    final: bool = False  # on a head: the response is complete (non-streaming), nothing follows
    #: on an error: the worker whose failure ended the request when it is not the sender (the
    #: prefill worker of a disaggregated pair, whose decode leg was stopped): a retry avoids it
    failed_worker: str = ""
    #: on an error: the engine was never reached (its connection refused): nothing of the request
    #: ran, so trying another worker cannot run it twice
    unreached: bool = False


class Release(_Msg):
    """Worker-agent -> router: the request behind this lease is finished."""

    lease_id: str
    worker_id: str
    outcome: Literal["ok", "error", "cancelled", "expired"]
    #: with outcome "error": the engine refused the connection (not listening: stopped, crashed,
    #: restarting), which the router's breaker takes at once rather than after several faults
    unreachable: bool = False


class Prefilled(_Msg):
    """Worker-agent -> router: the streamed request behind this lease produced its first token.

    Its prefill is done; from now on it only decodes. Sent at most once per lease, before the
    Release, and only for streamed requests (a unary answer arrives whole, so its Release says it all).
    """

    lease_id: str
    worker_id: str


class Cancel(_Msg):
    """Frontend -> worker-agent: stop this request (client gone or timed out); router -> worker-agent:
    stop one leg of a disaggregated request because the other failed (``status`` 502 and why)."""

    request_id: str
    status: int = 499  # the error frame the requester gets; 499 = the requester itself cancelled
    message: str = ""
    # the requester gave up on this worker (nothing from it for --upstream-timeout): the lease is
    # released as an ``error``, which the router's circuit breaker counts against the worker
    worker_fault: bool = False
    #: router -> worker-agent: the worker whose leg failed (the prefill's), named in the error frame
    failed_worker: str = ""
    #: the attempt to stop, by its lease, when the sender knows it: an attempt of the same request on
    #: the same worker under another lease (a retry after this one failed) is not stopped or refused
    lease_id: str = ""


class FramesQuery(_Msg):
    """Frontend -> worker-agent (``frames_query_subject``), or -> the router that runs the requests
    on engines itself (``router_frames_query_subject``), after the frontend reconnected to the
    broker, or about requests silent for a while (is their sender still on the bus?): how many
    frames has each of these requests sent so far?"""

    request_ids: list[str]
    worker_id: str | None = None  # the requests' worker: a router answering for many workers needs it


class FramesSent(_Msg):
    """Worker-agent (or router) -> frontend: frames sent per request it runs or finished lately; a
    request it does not know (never received: lost from its queue with a restarted broker) is left
    out."""

    sent: dict[str, int]


class FramesReplay(_Msg):
    """Frontend -> worker-agent (``frames_replay_subject``) or router (``router_frames_replay_subject``):
    send this request's frames from number ``from_seq`` on again, to its reply subject (some never
    arrived)."""

    request_id: str
    from_seq: int = Field(ge=0)
    worker_id: str | None = None  # as in ``FramesQuery``


class FramesReplayed(_Msg):
    """Worker-agent (or router) -> frontend: how many frames it sent again, published before this
    answer; -1 when it cannot (the request is unknown, or those frames are no longer kept)."""

    count: int


class KvRelay(_Msg):
    """Worker-agent -> KV event stream (``kv_event_subject``): one engine event batch.

    ``kind="blocks"`` (what the worker-agent sends): the batch as the change it made to the index
    hashes this rank holds (``kv_translate.BlockDelta``): ``reset`` — everything held before is
    gone; ``stored`` / ``removed`` — block size -> the touched index hashes
    (``block_hash.pack_hashes``) held / not held at the end. ``seq`` is the engine batch's sequence
    number; ``first_seq``, when set, the first of several batches this relay carries (the agent
    resends the changes of a relay JetStream did not acknowledge with the next one).
    ``kind="batch"``: ``payload`` is the engine's msgpack batch exactly as read from its ZMQ
    publisher (decode with ``kv_wire.decode_batch``); the kv-indexer translates it itself.
    ``kind="cleared"``: the agent's engine (re)started with an empty cache: forget every block of
    this worker (all ranks when ``dp_rank`` is None).
    ``kind="state"``: every index hash the rank holds after engine batch ``seq`` (``stored``; the
    agent's answer to a ``KvResync``), in parts: the first has ``reset`` (replace what the index
    holds), the others add to it. Stale (``seq`` below what the index applied) parts are skipped.
    """

    worker_id: str
    kind: Literal["blocks", "batch", "cleared", "state"] = "batch"
    dp_rank: int | None = None
    seq: int = -1
    first_seq: int | None = None
    payload: bytes = b""
    reset: bool = False
    stored: dict[int, bytes] = Field(default_factory=dict)
    removed: dict[int, bytes] = Field(default_factory=dict)
    block_size: int | None = None  # the engine's resolved page size, when the agent knows it
    ts: float = Field(default_factory=time.time)

    @model_validator(mode="after")
    def _first_seq_not_after_seq(self) -> KvRelay:
        if self.first_seq is not None and self.first_seq > self.seq:
            raise ValueError(f"first_seq {self.first_seq} is after seq {self.seq}")
        return self


class KvResync(_Msg):
    """kv-indexer (or a router keeping its own index) -> every worker-agent (``KV_RESYNC``): relay
    what each rank holds now (``KvRelay(kind="state")``). Sent once the index has replayed the
    stream at start: blocks whose store events left the stream before (its max age or size, or a
    broker that lost its store) are still cached by the engines, and never announced again."""

    requester: str


class OverlapQuery(_Msg):
    """Router -> kv-indexer (``KV_QUERY``): how much of this request's prefix each worker holds.

    ``hashes`` maps a block size to the request's chained block hashes at that size
    (``block_hash.block_hashes``); the router sends one entry per block size in its fleet.
    """

    model: str
    hashes: dict[int, list[int]]
    workers: list[str] | None = None  # only these workers (None: every worker of the model)


class WorkerOverlap(_Msg):
    worker_id: str
    dp_rank: int | None = None
    blocks: int  # matched prefix depth, in the worker's blocks


class OverlapReply(_Msg):
    """kv-indexer -> router: matched prefix depth per worker (and DP rank); absent means 0. And how
    many blocks each of them holds."""

    overlaps: list[WorkerOverlap] = Field(default_factory=list)
    #: workers of the model whose events the index has never seen (their depth is unknown, not 0)
    unseen: list[str] = Field(default_factory=list)
    #: blocks each target of the asked workers holds in the index, depth or not (``blocks`` = its
    #: whole holding): with the record's ``kv_capacity_tokens``, how full its cache is (older
    #: indexers send none: nothing is known)
    held: list[WorkerOverlap] = Field(default_factory=list)
