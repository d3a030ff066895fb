"""`infera up`: start nats-server, kv-indexer, router, frontend and N mock workers as local processes.

With ``--discovery-backend etcd`` it also starts a one-member etcd and every service discovers the
fleet there. ``--request-transport`` and ``--kv-event-transport`` go to every process; with etcd,
http and zmq together (the runbooks' no-broker plane) no nats-server is started and the
kv-indexer, router and frontend run as one ``python -m infera.server``.

Ctrl-C or SIGTERM stops everything it started (each child runs in its own process group and is
stopped TERM-then-KILL), leaving no process behind: the frontend (or server) first, which refuses
new requests and drains its answers under way; then all workers together; then the rest. A
nats-server, etcd, kv-indexer, router, frontend or server that exits is started again, with the
same command line, ports and store (at most 5 times each within 10 minutes; the services ride
out the outage and restore their state from the bus and etcd); a worker
that exits leaves the fleet (its engine's cold start is the operator's call).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator

from infera.fleet_plan import ProcSpec, no_broker, plan_fleet
from infera.procs import free_port, start_etcd, start_nats, stop_processes, wait_port
from infera.server_settings import ServerSettings
from infera_common.models import BUNDLED_MODEL_NAME
from infera_common.ports import IN_USE, bind_failure
from infera_common.settings import PlaneChoices, TracingSettings, directory_to_write, parse_cli
from infera_frontend.settings import ApiAddressSettings, ApiKeySettings
from infera_router.settings import PolicySettings
from infera_worker_agent.settings import AgentSettings


#: How many times nats-server, etcd or a control-plane service that exited is started again within
#: ``RESTART_WINDOW`` seconds before the fleet is stopped (each counted apart; a service that fails
#: at once fails this many times quickly; one crash a day is restarted every day).
RESTARTS = 5
RESTART_WINDOW = 600.0


class UpSettings(TracingSettings, ApiAddressSettings, ApiKeySettings, PolicySettings, PlaneChoices):
    """``infera up``'s own flags; ``--host``/``--port``, ``--api-key``, ``--router-policy`` and the plane
    flags are the frontend's, the router's and every service's, passed on to the processes it starts
    (the keys in the frontend's environment, not on its command line)."""

    workers: int = Field(2, ge=0, le=64, description="Number of aggregated mock engines (each behind a worker-agent).")
    prefill_workers: int = Field(
        0, ge=0, le=64,
        description="Number of prefill mock engines (SGLang bootstrap protocol); needs --decode-workers too.",
    )
    decode_workers: int = Field(
        0, ge=0, le=64, description="Number of decode mock engines; needs --prefill-workers too.",
    )
    pd_protocol: Literal["sglang-bootstrap", "vllm-mooncake"] = Field(
        "sglang-bootstrap",
        description="How the prefill and decode mock engines hand over the KV: SGLang's bootstrap rooms, "
        "or vLLM's Mooncake connector (the mock engines then speak the vLLM flavour).",
    )
    engine_arg: list[str] = Field(
        default_factory=list,
        description="Extra mock-engine arguments, shell-split, e.g. --engine-arg='--speedup 10'. Repeatable.",
    )
    nats_port: int = Field(0, ge=0, le=65535, description="nats-server port (0: a free port).")
    etcd_port: int = Field(0, ge=0, le=65535, description="etcd client port with --discovery-backend etcd "
                           "(0: a free port).")
    state_dir: str | None = Field(None, description="Directory for JetStream state and logs (default: a temp dir).")
    ready_timeout: float = Field(
        60.0, gt=0,
        description="Seconds the fleet may go without progress (one more worker listed, or turned active) "
        "before infera up gives up starting it.",
    )

    @field_validator("state_dir")
    @classmethod
    def _state_dir_form(cls, value: str | None) -> str | None:
        return None if value is None else directory_to_write(value)


def port_problems(settings: UpSettings, bind: Callable[[str, int], str | None] = bind_failure) -> list[str]:
    """The ports given on the command line that cannot be listened on, each naming its flag: found
    before anything starts (nats-server on a port another process holds exits at once, and the
    services would then wait for a NATS that is not there)."""
    given = [("--port", settings.host, settings.port), ("--nats-port", "127.0.0.1", settings.nats_port)]
    if settings.discovery_backend == "etcd":
        given.append(("--etcd-port", "127.0.0.1", settings.etcd_port))
    problems = []
    for flag, host, port in given:
        failure = bind(host, port) if port else None
        if failure is not None:
            fix = "choose another" if failure == IN_USE else "give one of this host's addresses to --host"
            problems.append(f"{flag} {port}: {host}:{port} is {failure}; {fix}"
                            + (" (0 picks a free one)" if flag != "--port" and failure == IN_USE else ""))
    return problems


def main(argv: list[str]) -> int:
    # the services it starts read the same environment: a mistyped variable of theirs stops it too
    settings, _ = parse_cli(UpSettings, argv, prog="infera up", description=__doc__,
                            env_for=(ServerSettings, AgentSettings))
    if problems := port_problems(settings):
        for problem in problems:
            print(f"infera up: error: {problem}", file=sys.stderr)
        return 2
    port = settings.port or free_port()
    nats_port = settings.nats_port or free_port()
    nats_url = f"nats://127.0.0.1:{nats_port}"
    etcd_port = (settings.etcd_port or free_port()) if settings.discovery_backend == "etcd" else None
    etcd_peer_port = free_port() if etcd_port else None  # the same on a restart: its store names it
    etcd_endpoint = f"127.0.0.1:{etcd_port}" if etcd_port else None
    engine_args = [a for raw in settings.engine_arg for a in shlex.split(raw)]
    total = settings.workers + settings.prefill_workers + settings.decode_workers
    try:
        plan = plan_fleet(
            nats_url=nats_url,
            host=settings.host,
            port=port,
            workers=settings.workers,
            router_policy=settings.router_policy,
            engine_args=engine_args,
            metrics_ports=[free_port() for _ in range(total + 2)],
            prefill_workers=settings.prefill_workers,
            decode_workers=settings.decode_workers,
            pd_protocol=settings.pd_protocol,
            etcd_endpoint=etcd_endpoint,
            request_transport=settings.request_transport,
            kv_event_transport=settings.kv_event_transport,
            otlp_traces_endpoint=settings.otlp_traces_endpoint,
        )
    except ValueError as exc:
        print(f"infera up: error: {exc}", file=sys.stderr)
        return 2
    keys = settings.api_keys()
    if keys:  # in the environment of the process serving the HTTP API: a command line is visible to all
        plan = [replace(spec, env={**spec.env, "INFERA_API_KEY": ",".join(keys)})
                if spec.role in ("frontend", "server") else spec for spec in plan]
    state = Path(settings.state_dir or tempfile.mkdtemp(prefix="infera-up-"))
    logs = state / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    worker_names = {spec.name for spec in plan if spec.role == "worker"}
    running: list[tuple[str, subprocess.Popen]] = []
    stopping = False

    def request_stop(signum, _frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    try:
        broker_free = no_broker(etcd_endpoint, settings.request_transport, settings.kv_event_transport)
        if not broker_free:
            with open(logs / "nats-server.log", "ab") as f:
                running.append(("nats-server", start_nats(nats_port, state / "jetstream", log_file=f)))
        if etcd_port:
            try:
                with open(logs / "etcd.log", "ab") as f:
                    running.append(("etcd", start_etcd(etcd_port, state / "etcd", etcd_peer_port, log_file=f)))
            except (OSError, RuntimeError, TimeoutError) as exc:  # not installed, port taken, ...
                print(f"infera up: error: cannot start etcd: {exc}; see {logs / 'etcd.log'}", file=sys.stderr)
                return 1
        url = f"http://{_client_host(settings.host)}:{port}"
        for spec in plan:
            if spec.role == "worker" and not any(name in worker_names for name, _ in running):
                # the frontend holds its port before any worker-agent picks free ports for its engine:
                # a port chosen for the frontend but not yet bound could otherwise go to an engine
                front = "server" if broker_free else "frontend"
                frontend = next(proc for name, proc in running if name == front)
                try:
                    wait_port(_client_host(settings.host), port, settings.ready_timeout, frontend)
                except (RuntimeError, TimeoutError) as exc:
                    print(f"infera up: {front} did not start: {exc}; see {logs / (front + '.log')}", file=sys.stderr)
                    _tail(logs / f"{front}.log")
                    return 1
            running.append((spec.name, _spawn(spec, logs)))
        active = _wait_ready(url, total, settings.ready_timeout, running, lambda: stopping, logs,
                             keys[0] if keys else None)
        if active is None:
            return 1
        where = [] if broker_free else [f"NATS {nats_url}"]
        where += [f"etcd {etcd_endpoint}"] if etcd_endpoint else []
        _print_banner(url, (active[0].get("model") if active else None) or BUNDLED_MODEL_NAME, ", ".join(where), logs,
                      bool(keys))
        reported: set[str] = set()
        restarts = RestartBudget(RESTARTS, RESTART_WINDOW)
        specs = {spec.name: spec for spec in plan if spec.name not in worker_names}
        stores: dict[str, tuple[int, Callable[[Any], subprocess.Popen]]] = {
            "nats-server": (nats_port, lambda f: start_nats(nats_port, state / "jetstream", log_file=f)),
        }
        if etcd_port:
            stores["etcd"] = (etcd_port, lambda f: start_etcd(etcd_port, state / "etcd", etcd_peer_port, log_file=f))
        while not stopping:
            for i, (name, proc) in enumerate(list(running)):
                if proc.poll() is None or name in reported:
                    continue
                if (name in stores or name in specs) and restarts.take(name, time.monotonic()):
                    if name in stores:
                        restarted = _restart_store(name, *stores[name], logs, proc.returncode)
                    else:
                        restarted = _restart(specs[name], logs, proc.returncode, restarts.used(name))
                    if restarted is not None:
                        running[i] = (name, restarted)
                        continue
                reported.add(name)
                print(f"infera up: {name} exited with {proc.returncode}; see {logs / (name + '.log')}",
                      file=sys.stderr)
                _tail(logs / f"{name}.log")
                if name not in worker_names:
                    return 1  # the control plane is gone for good: stop the fleet
                # a worker leaving is what the fleet is built to survive: the rest keep serving
            time.sleep(0.2)
        return 0
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        # the front door first: it refuses new requests at once and drains the answers under way
        # while the workers still serve them; then every worker together (each drains and stops its
        # engine); then the rest of the control plane; etcd and NATS last
        for group, timeout in _stop_order(running, worker_names):
            stop_processes(group, timeout)
        print("infera up: stopped", file=sys.stderr)


#: Seconds a draining process gets before SIGKILL: --drain-timeout's default (30) and a margin.
DRAIN_GRACE = 40.0
#: The same for the processes that have nothing to drain.
STOP_GRACE = 10.0


def _stop_order(running: list[tuple[str, subprocess.Popen]],
                worker_names: set[str]) -> list[tuple[list[subprocess.Popen], float]]:
    """The processes to stop, in groups stopped one after the other, each with its grace."""
    front = [p for n, p in running if n in ("frontend", "server")]
    workers = [p for n, p in running if n in worker_names]
    backing = [p for n, p in running if n in ("nats-server", "etcd")]
    rest = [p for _, p in running if not any(p in g for g in (front, workers, backing))]
    return [(front, DRAIN_GRACE), (workers, DRAIN_GRACE), (rest, STOP_GRACE), (backing, STOP_GRACE)]


class RestartBudget:
    """At most ``limit`` restarts of each process within any ``window`` seconds (pure)."""

    def __init__(self, limit: int, window: float) -> None:
        self.limit, self.window = limit, window
        self._times: dict[str, list[float]] = {}

    def take(self, name: str, now: float) -> bool:
        """One restart of ``name`` at ``now``, if the budget allows it."""
        recent = [t for t in self._times.get(name, []) if now - t < self.window]
        if len(recent) >= self.limit:
            self._times[name] = recent
            return False
        self._times[name] = [*recent, now]
        return True

    def used(self, name: str) -> int:
        return len(self._times.get(name, []))


def _restart_store(name: str, port: int, start: Callable[[Any], subprocess.Popen], logs: Path,
                   code: int | None) -> subprocess.Popen | None:
    """nats-server or etcd exited under the fleet: start it again on the same port and store (the
    services reconnect and restore their queues, records, leases and watches); None when it does
    not come up."""
    print(f"infera up: {name} exited with {code}; starting it again on port {port}", file=sys.stderr)
    try:
        with open(logs / f"{name}.log", "ab") as f:
            return start(f)
    except (OSError, RuntimeError, TimeoutError) as exc:
        print(f"infera up: {name} did not come back: {exc}; see {logs / (name + '.log')}", file=sys.stderr)
        return None


def _restart(spec: ProcSpec, logs: Path, code: int | None, attempt: int) -> subprocess.Popen:
    """A control-plane service exited under the fleet: start it again with the same command line
    (ports included). A router or kv-indexer keeps no state of its own that the bus does not give
    back (discovery, the KV event stream), and the frontend holds only requests under way."""
    print(f"infera up: {spec.name} exited with {code}; starting it again ({attempt} of {RESTARTS} within "
          f"{RESTART_WINDOW:.0f} s); "
          f"see {logs / (spec.name + '.log')}", file=sys.stderr)
    return _spawn(spec, logs)


def _spawn(spec: ProcSpec, logs: Path) -> subprocess.Popen:
    log = open(logs / f"{spec.name}.log", "ab")
    return subprocess.Popen(
        spec.argv(sys.executable), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        env={**os.environ, **spec.env} if spec.env else None,
        start_new_session=True,
    )


def _client_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def _wait_ready(url: str, workers: int, timeout: float, running, stopping, logs: Path,
                api_key: str | None = None) -> list[dict] | None:
    """The active worker records once ``workers`` of them are listed; None when the fleet failed, stops,
    or made no progress (one more worker listed, or turned active) for ``timeout`` seconds: a large
    fleet starting on few cores takes more than that in all, each worker ~1 s of CPU to start."""
    deadline = time.monotonic() + timeout
    progress, listed, active = (-1, -1), [], []
    while time.monotonic() < deadline and not stopping():
        for name, proc in running:
            if proc.poll() is not None:
                print(f"infera up: {name} exited with {proc.returncode} during start-up; the end of "
                      f"{logs / (name + '.log')}:", file=sys.stderr)
                _tail(logs / f"{name}.log")
                return None
        try:
            ask = urllib.request.Request(f"{url}/v1/workers",
                                         headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
            with urllib.request.urlopen(ask, timeout=1) as resp:
                listed = json.load(resp).get("data", [])
            active = [w for w in listed if w.get("status") == "active"]
            if len(active) >= workers:
                return active
            if (len(listed), len(active)) != progress:
                progress, deadline = (len(listed), len(active)), time.monotonic() + timeout
        except OSError:
            pass
        time.sleep(0.25)
    if not stopping():
        print(f"infera up: the fleet was not ready: {len(active)} of {workers} workers active ({len(listed)} "
              f"listed), none more for {timeout:g}s; see the workers' logs in {logs}, or raise --ready-timeout",
              file=sys.stderr)
    return None


def _tail(path: Path, lines: int = 20) -> None:
    try:
        for line in path.read_text(errors="replace").splitlines()[-lines:]:
            print(f"  {line}", file=sys.stderr)
    except OSError:
        pass


def _print_banner(url: str, model: str, where: str, logs: Path, keyed: bool = False) -> None:
    """The endpoint, and a curl line for the model the workers serve (``--served-model-name`` included);
    with ``--api-key`` the line sends ``$INFERA_API_KEY`` (the key itself is not printed)."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello!"}],
                       "max_tokens": 16})
    auth = ' -H "Authorization: Bearer ${INFERA_API_KEY%%,*}"' if keyed else ""  # (the first of the keys)
    print(f"Infera is up: OpenAI endpoint {url}/v1  ({where}; logs in {logs})")
    print(f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'")
    print("Ctrl-C stops the fleet.", flush=True)
