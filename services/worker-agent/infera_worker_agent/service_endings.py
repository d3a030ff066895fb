"""The worker-agent's ways out (``service.Agent`` inherits them): a startup that failed, an engine
that died while serving, a drain after SIGTERM, and the cleanup every path ends with. Each step
that needs the broker is skipped while it is unreachable (what the broker holds ages out)."""

from __future__ import annotations

from infera_common.logs import get_logger
from infera_common.nats_conn import close_connection, delete_stream_quietly, flush_all
from infera_common.schemas import WorkerStatus
from infera_worker_agent.engine_drain import drain_engine
from infera_worker_agent.engine_proc import exit_status
from infera_worker_agent.health import Startup
from infera_worker_agent.load import scrape_engine
from infera_worker_agent.worker import StopReason

log = get_logger("worker_agent")

DRAIN_REFUSAL = StopReason("cancelled", 503, "worker is draining; retry on another worker", abort_engine=False)
DRAIN_CANCEL = StopReason("cancelled", 503, "worker stopped: drain timeout reached")
ENGINE_GONE_REFUSAL = StopReason("error", 503, "worker's engine exited; retry on another worker", abort_engine=False)
ENGINE_GONE = StopReason("error", 502, "engine exited while answering", abort_engine=False)


class Endings:
    """Uses the agent's engine, registrar, request worker, watch, connection and settings (set by
    ``Agent``); ``_close_kv_relay`` is the agent's own."""

    async def _startup_failed(self, startup: Startup) -> int:
        assert self._engine is not None and self._registrar is not None
        await self._deregister()
        if startup is Startup.STOPPED:
            log.info("stopped_during_startup", worker_id=self.worker_id)
            await self._stop_engine()
            return 0
        if startup is Startup.EXITED:
            code = self._engine.returncode if self._engine.returncode is not None else await self._engine.wait()
            await self._engine.close()
            self.metrics.engine_exit_code.set(exit_status(code))
            log.error("engine_exited_during_startup", exit_code=code, output_tail=self._engine.tail())
            return exit_status(code)
        log.error("engine_health_timeout", timeout_s=self.s.health_timeout, url=self.plan.local_url,
                  output_tail=self._engine.tail()[-10:])
        await self._stop_engine()
        return 1

    async def _engine_died(self) -> int:
        assert self._engine is not None and self._registrar is not None
        await self._stop_health()
        code = self._engine.returncode
        self.metrics.engine_up.set(0)
        self.metrics.engine_exit_code.set(exit_status(code))
        log.error("engine_exited", exit_code=code, output_tail=self._engine.tail())
        await self._deregister()
        if self._worker is not None:  # NATS request plane: answer what was in flight or queued
            await self._worker.abandon(ENGINE_GONE_REFUSAL, ENGINE_GONE)
        await self._close_worker()
        await self._delete_stream()
        await self._engine.stop(self.s.engine_stop_timeout)  # its children, if any are left
        return exit_status(code)

    async def _drain_and_stop(self) -> int:
        assert self._registrar is not None
        await self._stop_health()  # (its verdicts would overwrite 'draining')
        # on http the agent sees no requests: the engine's own count says what there is to drain
        held = ({"in_flight": self._worker.in_flight} if self._worker is not None
                else {"engine_requests": self._watch.engine_work()} if self._watch is not None else {})
        log.info("draining", worker_id=self.worker_id, drain_timeout_s=self.s.drain_timeout, **held)
        if self._discovery_unreachable():
            log.warning("draining_status_not_published", error="NATS unreachable")
        else:
            try:
                await self._registrar.set_status(WorkerStatus.DRAINING)
            except Exception as exc:
                log.warning("draining_status_not_published", error=str(exc))
        if self._worker is not None:  # NATS request plane
            await self._worker.drain(DRAIN_REFUSAL, DRAIN_CANCEL, self.s.drain_timeout, self._force)
        else:
            assert self._session is not None and self._engine is not None
            await drain_engine(lambda: scrape_engine(self._session, f"{self.plan.local_url}/metrics", 2.0),
                               self.s.drain_timeout, self._force, self._engine)
        await self._deregister()
        await self._close_worker()
        await self._delete_stream()
        if self._watch is not None:  # no load scrape of an engine being stopped (a warning per worker)
            await self._watch.stop()
        await self._stop_engine()
        log.info("stopped", worker_id=self.worker_id)
        return 0

    async def _stop_health(self) -> None:
        if self._watch is not None:
            await self._watch.stop_health()

    def _broker_unreachable(self) -> bool:
        """NATS is in use and its connection is down (reconnecting): a broker call now would only wait
        out its timeout, so the stop path skips them (a SIGTERM during an outage still stops in
        seconds; what the broker holds ages out or goes with it)."""
        return self._nc is not None and not self._nc.is_connected

    def _discovery_unreachable(self) -> bool:
        return self.s.discovery_backend == "nats" and self._broker_unreachable()

    async def _deregister(self) -> None:
        if self._registrar is not None:
            registrar, self._registrar = self._registrar, None
            # every frame and Release sent so far is on the broker before the leave
            if self._nc is not None and not self._broker_unreachable():
                try:
                    await flush_all(self._nc, timeout=2)
                except Exception as exc:  # broker gone: nothing sent now would arrive anyway
                    log.info("flush_before_leave_failed", error=str(exc) or type(exc).__name__)
            leave = not self._discovery_unreachable()
            if not leave:
                log.warning("deregister_skipped", worker_id=self.worker_id, error="NATS unreachable",
                            entry_expires_within_s=registrar.record.ttl)
            await registrar.stop(leave=leave)

    async def _close_worker(self) -> None:
        if self._worker is not None:
            await self._worker.close()

    async def _stop_engine(self) -> None:
        if self._engine is not None:
            code = await self._engine.stop(self.s.engine_stop_timeout)
            self.metrics.engine_up.set(0)
            self.metrics.engine_exit_code.set(exit_status(code) if code else 0)

    async def _delete_stream(self) -> None:
        if self._nc is not None and self._stream is not None and not self._broker_unreachable():
            await delete_stream_quietly(self._nc.jetstream(), self._stream)
            self._stream = None

    async def _cleanup(self) -> None:
        """Whatever the path out: nothing left running, the engine stopped, the entry gone."""
        steps = [
            ("restore", self._reconnects.close),
            ("engine_watch", self._watch.stop if self._watch else None),
            ("worker", self._close_worker),
            ("kv_relay", self._close_kv_relay),
            ("deregister", self._deregister),
            ("engine", self._stop_engine if self._engine else None),
            ("http_session", self._session.close if self._session else None),
            ("nats", (lambda: close_connection(self._nc, timeout=2)) if self._nc else None),
            ("metrics_server", self._metrics_runner.cleanup if self._metrics_runner else None),
        ]
        for name, step in steps:
            if step is None:
                continue
            try:
                await step()
            except Exception as exc:
                log.warning("cleanup_step_failed", step=name, error=str(exc) or type(exc).__name__)
