"""The worker-agent's life: launch the engine, wait for health, register, serve, drain, stop.

Per plane (``planes.py``): NATS is connected only when a plane uses it. ``--request-transport
nats``: requests come from the worker's JetStream work queue (``RequestWorker``) and a drain waits
for them; ``http``: routers call the engine at the record's ``url``, no stream is made, and a
drain waits for the engine's own running + waiting counts to reach zero (``engine_drain``).
``--kv-event-transport nats``: the engine's ZMQ events are relayed to JetStream; ``zmq``: the
record advertises the publishers and replay sockets, the agent only reads the block size from
the first stored block (``kv_probe``).

Exit status: 0 after a signal-initiated stop; the engine's exit status when the engine dies
(during startup or while serving); 1 for a health timeout or a startup failure of the agent;
2 for settings that cannot work (reported before the engine starts).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from urllib.parse import urlsplit

import aiohttp
from nats.aio.client import Client as NATS

from infera_common.discovery_select import FleetRegistrar, discovery_for
from infera_common.engine_relay import EngineAborter, Relay, bearer_header
from infera_common.logs import get_logger
from infera_common.metrics import start_metrics_server
from infera_common.nats_conn import (
    NO_JETSTREAM, Reconnects, connect, ensure_kv_event_stream,
    ensure_request_stream, nats_log_fields, no_jetstream,
)
from infera_common.request_runner import ENGINE_UNHEALTHY
from infera_common.runtime import freeze_startup_heap
from infera_common.schemas import KvRelay, LoadReport, WorkerRecord, WorkerStatus, encode, encode_sparse
from infera_common.subjects import kv_event_subject, load_subject
from infera_common.worker_claim import WorkerIdTaken
from infera_worker_agent.engine_cmd import EnginePlan, health_generates, redacted
from infera_worker_agent.engine_proc import EngineProcess
from infera_worker_agent.engine_watch import EngineWatch, finds_hangs
from infera_worker_agent.interpreter_probe import installed
from infera_worker_agent.health import (
    ModelCard, Startup, bootstrap_ranks, engine_json, refused_length, served_model, wait_healthy,
)
from infera_worker_agent.kv_learn import EngineKv
from infera_worker_agent.kv_follow import STATE_PATH, KvFollower, serve_state, state_url
from infera_worker_agent.kv_relay import KvRelayer
from infera_worker_agent.kv_resync import ResyncListener
from infera_worker_agent.lora_resolver import adapters_in, resolver_dir, with_adapters
from infera_worker_agent.metrics import AgentMetrics
from infera_worker_agent.pd_report import (
    PdState, bootstrap_query_url, needs_bootstrap_query, planned_state, reported_state,
)
from infera_worker_agent.pd_role import PdPlan
from infera_worker_agent.planes import plane_warnings
from infera_worker_agent.recipes import engine_env
from infera_worker_agent.service_endings import Endings
from infera_worker_agent.settings import AgentSettings
from infera_worker_agent.worker import RequestWorker

log = get_logger("worker_agent")


class Agent(Endings):
    def __init__(self, settings: AgentSettings, plan: EnginePlan) -> None:
        self.s = settings
        self.plan = plan
        self.worker_id: str = settings.worker_id  # type: ignore[assignment]
        self.metrics = AgentMetrics()
        self._stop = asyncio.Event()
        self._reconnects = Reconnects()  # what to restore when the broker comes back (it may have restarted)
        self._watch: EngineWatch | None = None  # load reports and health probes, while serving
        self._force = asyncio.Event()
        self._nc: NATS | None = None
        self._registrar: FleetRegistrar | None = None
        self._model = self.plan.model_hint or "unknown"  # the served model, told in load reports
        self._context_length: int | None = None  # the engine's, once healthy (record: context_length)
        self._names = ModelCard("")  # the engine's other served names and adapters, once healthy (record)
        self._engine: EngineProcess | None = None
        self._session: aiohttp.ClientSession | None = None
        self._worker: RequestWorker | None = None
        self._metrics_runner = None
        self._metrics_port = 0  # bound, once the metrics server runs
        self._stream: str | None = None
        self._started_at = time.time()
        self._kv = EngineKv(settings.kv_index_block_size)  # learnt from the running engine
        self._kv_relayer: KvRelayer | KvFollower | None = None
        self._kv_resync: ResyncListener | None = None
        assert plan.pd is not None, "plan_engine reads the role from the engine's flags"
        self._pd_plan: PdPlan = plan.pd
        self._pd: PdState = planned_state(self._pd_plan, plan.advertise_host)
        engine_environ = {**os.environ, **dict(plan.env_changes)}
        # whether the engine's own /health runs a generation (the plan's arguments and environment)
        self._health_generates = health_generates(plan.engine, plan.engine_args, engine_environ)
        # where a vLLM engine's LoRA resolver finds adapters it loads on first use (None: it has none)
        self._resolver_dir = resolver_dir(self._pd_plan.family, engine_environ, plan.engine_args)

    # --- entry point ---------------------------------------------------------------------------
    async def run(self) -> int:
        self._install_signals()
        try:
            return await self._run()
        except Exception as exc:  # a server without JetStream is said in words, anything else with its trace
            hint = {"error": NO_JETSTREAM} if no_jetstream(exc) else {"exc_info": True}
            log.error("agent_failed", worker_id=self.worker_id, **hint)
            return 1
        finally:
            await self._cleanup()

    def _install_signals(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)

    def _on_signal(self, sig: int) -> None:
        if self._stop.is_set():
            log.warning("second_stop_signal_skipping_drain", signal=signal.Signals(sig).name)
            self._force.set()
        else:
            log.info("stop_signal", signal=signal.Signals(sig).name)
        self._stop.set()

    async def _run(self) -> int:
        try:
            self._metrics_runner, port = await start_metrics_server(
                self.metrics.registry, self.s.metrics_host, self.s.metrics_bind_port(),
                routes={STATE_PATH: self._serve_kv_state},
            )
        except OSError as exc:
            log.error("metrics_port_unavailable", host=self.s.metrics_host, port=self.s.metrics_bind_port(),
                      error=str(exc),
                      hint="pass --metrics-port 0 for a free port, or another port")
            return 2
        self._metrics_port = port
        log.info("agent_starting", worker_id=self.worker_id, engine=self.s.engine, engine_url=self.plan.url,
                 metrics_port=port, argv=redacted(self.plan.argv), role=self._pd.role.value)
        for note in self._pd_plan.notes:
            log.warning("pd_flags", note=note)
        for note in self.plan.notes:
            log.info("recipe", note=note)
        if self.plan.env_changes:
            log.info("engine_env", set=dict(self.plan.env_changes))
        if (failed := await self._join_planes()) is not None:
            return failed

        self._session = aiohttp.ClientSession(  # every call of it goes to this engine (or its bootstrap server)
            connector=aiohttp.TCPConnector(limit=self.s.max_pending + 64),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
            headers=bearer_header(self.plan.api_key),
        )
        self._engine = await EngineProcess.spawn(
            self.plan.argv, grace=self.s.engine_stop_timeout, echo=sys.stdout.buffer,
            env=engine_env(os.environ, self.plan), secrets=[self.plan.api_key] if self.plan.api_key else [],
        )
        startup = await wait_healthy(self._session, self.plan.local_url, self._engine, self.s.health_timeout,
                                     self._stop)
        if startup is not Startup.HEALTHY:
            return await self._startup_failed(startup)

        card = await served_model(self._session, self.plan.local_url)
        if card is not None and self._resolver_dir is not None:
            card = await self._resolvable(card)
        model = card.id if card else self.plan.model_hint or "unknown"
        self._names = card or ModelCard(model)
        info = await engine_json(self._session, f"{self.plan.local_url}/server_info")
        info = info if isinstance(info, dict) else None
        self._context_length = refused_length(card, info)
        await self._kv.learn(self._session, self.plan, info)
        await self._learn_pd(info)
        js = self._nc.jetstream() if self._nc is not None else None
        await self._start_kv_relay(js)
        if self.s.request_transport == "nats":
            await self._start_request_worker(js)
        self._model = model
        self._registrar.record = self._record(model, WorkerStatus.STARTING)
        frozen = freeze_startup_heap()  # before any request can be routed here
        await self._registrar.set_status(WorkerStatus.ACTIVE)
        self.metrics.engine_up.set(1)
        self._watch = EngineWatch(
            self.s, self._session, self.plan.local_url, model=model, role=self._pd.role, family=self._pd_plan.family,
            metrics=self.metrics,
            in_flight=lambda: self._worker.in_flight if self._worker else 0,
            sequences=lambda: self._worker.in_flight_sequences if self._worker else 0,
            by_router=lambda: self._worker.in_flight_by_router() if self._worker else {},
            work_by_router=lambda: self._worker.work_by_router() if self._worker else {},
            by_rank=lambda: self._worker.in_flight_by_rank() if self._worker else {},
            publish_load=self._publish_load, on_health=self._on_health, health_generates=self._health_generates,
            dp_size=self._pd.dp_size, names=self._names, on_names=self._on_names,
            resolvable=self._resolvable if self._resolver_dir is not None else None,
        )
        self._watch.start()
        log.info("worker_active", worker_id=self.worker_id, model=model, url=self.plan.url, frozen_objects=frozen)

        engine_exit = asyncio.create_task(self._engine.wait())
        stop = asyncio.create_task(self._stop.wait())
        await asyncio.wait({engine_exit, stop}, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if engine_exit.done():
            return await self._engine_died()
        engine_exit.cancel()
        return await self._drain_and_stop()

    async def _join_planes(self) -> int | None:
        """Connect to NATS if a plane uses it, and claim the worker id with the ``starting`` record; the
        exit code (logged) on failure: 2 when another live agent holds the id."""
        log.info("planes", request_transport=self.s.request_transport, kv_event_transport=self.s.kv_event_transport,
                 url=self.plan.url)
        for warning in plane_warnings(self.s, self.plan.advertise_host):
            log.warning("advertise_host_local_only", note=warning)
        uses = self.s.nats_uses()  # none on etcd + http + zmq: NATS is never dialled
        nats_url = self.s.nats_url if uses else ""
        if uses:
            try:
                self._nc = await connect(self.s.nats_url, name=f"worker-agent-{self.worker_id}",
                                         reconnects=self._reconnects)
            except ConnectionError as exc:
                log.error("nats_unreachable", error=str(exc), needed_by=list(uses))
                return 1
        discovery = discovery_for(self.s, self._nc.jetstream() if self._nc is not None else None)
        log.info("discovery", worker_id=self.worker_id, **nats_log_fields(nats_url, bool(uses)),
                 **discovery.log_fields())
        self._registrar = discovery.registrar(self._record(self._model, WorkerStatus.STARTING))
        try:
            await self._registrar.start()
        except ConnectionError as exc:  # etcd unreachable: before the engine starts, not after its cold start
            self._registrar = None
            log.error("discovery_unreachable", error=discovery.start_failed(exc, nats_url))
            return 1
        except WorkerIdTaken as exc:  # two agents, one id: refused before this one's engine starts
            self._registrar = None
            log.error("worker_id_taken", error=str(exc))
            return 2
        self._reconnects.add("broker_state", self._restore_broker_state)
        return None

    async def _start_request_worker(self, js) -> None:
        """The NATS request plane: this worker's work-queue stream and its durable consumer."""
        assert self._nc is not None and js is not None and self._session is not None
        self._stream = await ensure_request_stream(js, self.worker_id, self.s.max_pending, self.s.request_max_age)
        self._worker = RequestWorker(
            nc=self._nc, js=js, worker_id=self.worker_id, max_pending=self.s.max_pending,
            relay=Relay(self._session, self.plan.local_url),
            abort=EngineAborter(self._session, self.plan.local_url, self.plan.abort_path),
            metrics=self.metrics, finds_hangs=self._finds_hangs(),
        )
        await self._worker.start()

    def _finds_hangs(self) -> bool:
        """``engine_watch.finds_hangs`` for the role known now (the engine's report may change it)."""
        return finds_hangs(self.s, self._pd.role, self._pd_plan.family, self._health_generates)

    async def _on_health(self, healthy: bool) -> None:
        """The engine failed its probes (or passes again): routers stop (or resume) sending it work."""
        assert self._registrar is not None
        await self._registrar.set_status(WorkerStatus.ACTIVE if healthy else WorkerStatus.UNHEALTHY)
        if healthy:
            log.info("engine_healthy_again", worker_id=self.worker_id)
        else:  # what waits for a first token there is not coming: let the frontends try elsewhere
            # (on --request-transport http the routers call the engine and hand back their own calls)
            handed = {"requests_handed_back": self._worker.stop_unanswered(ENGINE_UNHEALTHY)} if self._worker else {}
            log.error("engine_unhealthy", worker_id=self.worker_id, failed_probes=self.s.health_check_failures,
                      url=f"{self.plan.local_url}/health", **handed,
                      hint="the engine process runs but does not answer; it gets no new requests until a probe "
                      "passes (restart it if it stays so)")
        self.metrics.engine_up.set(1 if healthy else 0)
        self.metrics.health_changes.labels("healthy" if healthy else "unhealthy").inc()

    async def _restore_broker_state(self) -> None:
        """After a reconnect, what a restarted broker lost, the queue before the record that sends
        routers to it: the work-queue stream and its consumer (unless sealed: on the way out), the
        KV event stream the relay publishes to, the discovery record (and bucket)."""
        assert self._nc is not None
        js = self._nc.jetstream()
        worker = self._worker
        if worker is not None and self._stream is not None and not worker.sealed:
            await ensure_request_stream(js, self.worker_id, self.s.max_pending, self.s.request_max_age)
            await worker.restore()
        if isinstance(self._kv_relayer, KvRelayer):
            await ensure_kv_event_stream(js)
        if self._registrar is not None:
            await self._registrar.restore()

    def _record(self, model: str, status: WorkerStatus) -> WorkerRecord:
        return WorkerRecord(
            worker_id=self.worker_id, model=model, aliases=list(self._names.aliases),
            adapters=list(self._names.adapters), engine=self.s.engine, role=self._pd.role,
            adapter_naming="model:name" if self._pd_plan.family == "sglang" else "name",
            pd=self._pd.pd,
            dp_size=self._pd.dp_size,
            url=self.plan.url, advertise_host=self.plan.advertise_host,
            discovery_backend=self.s.discovery_backend, request_transport=self.s.request_transport,
            kv_event_transport=self.s.kv_event_transport, status=status, max_pending=self.s.max_pending,
            finds_hangs=self._finds_hangs(), context_length=self._context_length,
            engine_api_key=self.plan.api_key is not None,
            clamps_max_tokens=self._pd_plan.family == "vllm",
            version=installed(["infera"]).get("infera", ""), ttl=self.s.discovery_ttl, started_at=self._started_at,
            **self._kv.record_fields(self.plan.advertise_host),
            kv_state_url=(state_url(self.s.metrics_host, self.plan.advertise_host, self._metrics_port)
                          if isinstance(self._kv_relayer, KvFollower) else None),
        )

    # --- prefill/decode role --------------------------------------------------------------------
    async def _learn_pd(self, info: dict | None) -> None:
        """The role and PD parameters as the running engine reports them (its report wins)."""
        assert self._session is not None
        query = None
        if needs_bootstrap_query(self._pd_plan, info):
            local_host = urlsplit(self.plan.local_url).hostname or "127.0.0.1"
            query = await bootstrap_ranks(self._session, bootstrap_query_url(self._pd_plan, local_host))
        self._pd, notes = reported_state(self._pd_plan, self.plan.advertise_host, info, query)
        for note in notes:
            log.warning("pd_report", note=note)
        pd = self._pd.pd
        log.info("role_found", role=self._pd.role.value, dp_size=self._pd.dp_size,
                 protocol=pd.protocol if pd else None, bootstrap_port=pd.bootstrap_port if pd else None,
                 engine_id=pd.engine_id if pd else None)

    # --- KV events -----------------------------------------------------------------------------
    async def _start_kv_relay(self, js) -> None:
        if not self._kv.sources:
            return
        if self.s.kv_event_transport == "zmq":  # the kv-indexer reads the publishers the record advertises
            self._kv_relayer = KvFollower(
                self.worker_id, self._kv.sources, self._kv.block_size,
                replay_timeout=self.s.kv_replay_timeout, on_block_size=self._on_engine_block_size,
                index_size_for=self._kv.index_size_for,
            )
            await self._kv_relayer.start()
            return
        await ensure_kv_event_stream(js)
        self._kv_relayer = KvRelayer(
            self.worker_id, self._kv.sources, self._kv.block_size, self._publish_kv, self.metrics,
            replay_timeout=self.s.kv_replay_timeout, on_block_size=self._on_engine_block_size,
            index_size_for=self._kv.index_size_for,
        )
        await self._kv_relayer.start()
        self._kv_resync = ResyncListener(self._nc, self._kv_relayer)
        await self._kv_resync.start()

    async def _on_engine_block_size(self, size: int) -> None:
        """The engine's KV events show another block size than the one registered: register theirs
        (the router hashes requests at the registered size; a wrong one would never match)."""
        self._kv.set_block_size(size)
        self._kv.note_block_size()
        await self._reregister()

    async def _resolvable(self, card: ModelCard) -> ModelCard:
        """``card`` with the adapters the engine's LoRA resolver would load (``lora_resolver.py``)."""
        assert self._resolver_dir is not None
        found = await asyncio.to_thread(adapters_in, self._resolver_dir, card.root)
        return with_adapters(card, found)

    async def _on_names(self, card: ModelCard) -> None:
        """The engine serves other names now (a LoRA adapter loaded or unloaded): register them."""
        self._names = card
        await self._reregister()

    async def _reregister(self) -> None:
        """Publish the record again, as it is now, with the status it has."""
        if self._registrar is not None:
            status = self._registrar.record.status
            self._registrar.record = self._record(self._model, status)
            await self._registrar.set_status(status)

    async def _serve_kv_state(self, _request):
        relayer = self._kv_relayer
        return await serve_state(relayer if isinstance(relayer, KvFollower) else None)

    async def _publish_kv(self, relay: KvRelay) -> None:
        assert self._nc is not None
        await self._nc.jetstream().publish(kv_event_subject(self.worker_id), encode_sparse(relay))

    async def _close_kv_relay(self) -> None:
        if self._kv_resync is not None:
            resync, self._kv_resync = self._kv_resync, None
            await resync.stop()
        if self._kv_relayer is not None:
            relayer, self._kv_relayer = self._kv_relayer, None
            await relayer.close()

    # --- load ----------------------------------------------------------------------------------
    async def _publish_load(self, report: LoadReport) -> None:
        if self._nc is None:  # no plane on NATS: the scrape only feeds the agent's own metrics
            return
        # say where this worker is registered: a service that does not list it can name the plane mix
        report.model, report.discovery_backend = self._model, self.s.discovery_backend
        report.etcd_endpoint = self.s.etcd_endpoint if self.s.discovery_backend == "etcd" else ""
        await self._nc.publish(load_subject(self.worker_id), encode(report))

