"""etcd discovery against a real etcd: joins, updates, leaves, lease expiry, outages, bad endpoints."""

import asyncio
import socket
import time

import pytest

from infera.procs import free_port
from infera_common.discovery_etcd import (
    MAX_LEASE_TTL, WORKERS_PREFIX, EtcdRegistrar, EtcdWatcher, diff_listing, lease_ttl,
)
from infera_common.discovery_select import discovery_for
from infera_common.etcd_gateway import EtcdClient, EtcdUnavailable, parse_endpoints, prefix_range_end
from infera_common.schemas import WorkerRecord, WorkerStatus
from infera_common.settings import PlaneSettings, parse_cli

TTL = 2.0  # the shortest lease etcd grants


def _record(wid: str, ttl: float = TTL, **kw) -> WorkerRecord:
    return WorkerRecord(worker_id=wid, model="m", engine="mock", url=f"http://127.0.0.1:1/{wid}",
                        advertise_host="127.0.0.1", ttl=ttl, discovery_backend="etcd",
                        status=WorkerStatus.ACTIVE, **kw)


async def _until(predicate, timeout: float) -> float:
    """Seconds until ``predicate()`` held; fails the test after ``timeout``."""
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"not true after {timeout}s")
        await asyncio.sleep(0.02)
    return time.monotonic() - t0


def _ids(watcher: EtcdWatcher) -> set[str]:
    return {r.worker_id for r in watcher.view.workers()}


def _kinds(changes, wid: str) -> list[str]:
    return [c.kind for c in changes if c.record.worker_id == wid]


# --- pure parts ---------------------------------------------------------------------------------


def test_relist_diff_reports_leaves_and_new_or_modified_workers_only():
    known = {"a": 5, "b": 7, "c": 9}
    listed = {"a": 5, "b": 8, "d": 10}
    assert diff_listing(known, listed) == (["c"], ["b", "d"])
    assert diff_listing(listed, listed) == ([], [])


def test_lease_ttl_is_whole_seconds_within_etcd_floor_and_30s():
    assert [lease_ttl(t) for t in (0.6, 2.0, 6.0, 6.2, 45.0)] == [2, 2, 6, 7, MAX_LEASE_TTL]
    assert MAX_LEASE_TTL == 30


def test_endpoint_forms():
    assert parse_endpoints("10.0.0.1:2379, http://e2:2380") == ["http://10.0.0.1:2379", "http://e2:2380"]
    for bad in ("etcd", "host:port", "", "ftp://h:1"):
        with pytest.raises(ValueError):
            parse_endpoints(bad)
    assert prefix_range_end(b"/infera/workers/") == b"/infera/workers0"
    assert prefix_range_end(b"a\xff") == b"b"


def test_settings_refuse_a_malformed_endpoint_and_a_lease_over_30s(capsys):
    with pytest.raises(SystemExit):
        parse_cli(PlaneSettings, ["--etcd-endpoint", "etcd.local"], prog="svc")
    assert "--etcd-endpoint" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_cli(PlaneSettings, ["--discovery-backend", "etcd", "--discovery-ttl", "31"], prog="svc")
    assert "with --discovery-backend etcd it is the etcd lease TTL: whole seconds, 2 to 30" in capsys.readouterr().err
    settings, _ = parse_cli(PlaneSettings, ["--discovery-backend", "etcd", "--discovery-ttl", "30"], prog="svc")
    assert settings.discovery_ttl == 30


# --- against a real etcd ------------------------------------------------------------------------


async def test_join_update_and_clean_leave(etcd_server):
    changes = []
    watcher = EtcdWatcher(etcd_server.endpoint, on_change=changes.append)
    await watcher.start()
    assert watcher.ready.is_set() and len(watcher.view) == 0
    reg = EtcdRegistrar(etcd_server.endpoint, _record("a", kv_block_size=16, max_pending=7))
    await reg.start()
    await _until(lambda: "a" in _ids(watcher), 5)
    assert changes[0].kind == "join" and changes[0].record == reg.record  # the full record
    assert watcher.view.get("a").kv_block_size == 16

    await reg.set_status(WorkerStatus.DRAINING)
    await _until(lambda: watcher.view.get("a").status == WorkerStatus.DRAINING, 5)
    assert _kinds(changes, "a") == ["join", "update"]
    assert watcher.view.models() == [] and watcher.view.known_model("m")

    # a watcher started later lists what is there before it says ready
    late = EtcdWatcher(etcd_server.endpoint)
    await late.start()
    assert _ids(late) == {"a"} and late.view.get("a") == reg.record

    await reg.stop()  # revokes the lease: the key goes at once
    await _until(lambda: len(watcher.view) == 0 and len(late.view) == 0, 2)
    assert _kinds(changes, "a") == ["join", "update", "leave"]
    await late.stop()
    await watcher.stop()


async def test_killed_registrar_leaves_within_its_ttl_while_a_live_one_stays(etcd_server):
    changes = []
    watcher = EtcdWatcher(etcd_server.endpoint, on_change=changes.append)
    await watcher.start()
    alive = EtcdRegistrar(etcd_server.endpoint, _record("alive"))
    killed = EtcdRegistrar(etcd_server.endpoint, _record("killed"))
    await alive.start()
    await killed.start()
    registered_at = time.monotonic()
    await _until(lambda: _ids(watcher) == {"alive", "killed"}, 5)
    assert killed.lease_ttl == TTL

    # a crash: no more keepalives and no revoke
    killed._task.cancel()
    await asyncio.gather(killed._task, return_exceptions=True)
    await killed._client.close()
    killed_at = time.monotonic()
    await _until(lambda: "killed" not in _ids(watcher), TTL + 3)
    assert time.monotonic() - killed_at <= TTL + 1.5
    assert _kinds(changes, "killed") == ["join", "leave"]

    # keepalives hold the live one well past its TTL
    await asyncio.sleep(max(0.0, registered_at + 2 * TTL - time.monotonic()))
    assert _ids(watcher) == {"alive"} and _kinds(changes, "alive") == ["join"]
    await alive.stop()
    await watcher.stop()


async def test_registrar_whose_lease_is_gone_registers_again_with_a_new_lease(etcd_server):
    changes = []
    watcher = EtcdWatcher(etcd_server.endpoint, on_change=changes.append)
    await watcher.start()
    reg = EtcdRegistrar(etcd_server.endpoint, _record("a"))
    await reg.start()
    first_lease = reg.lease_id
    await _until(lambda: "a" in _ids(watcher), 5)
    # what a registrar cut off from etcd for longer than its TTL finds when it is back
    admin = EtcdClient(etcd_server.endpoint)
    await admin.revoke(first_lease)
    await _until(lambda: _kinds(changes, "a") == ["join", "leave", "join"], TTL + 3)
    assert reg.lease_id != first_lease and watcher.view.get("a") == reg.record
    await admin.close()
    await reg.stop()
    await watcher.stop()


async def test_etcd_restart_fleet_view_complete_again(etcd_server):
    changes = []
    watcher = EtcdWatcher(etcd_server.endpoint, on_change=changes.append)
    await watcher.start()
    stays = EtcdRegistrar(etcd_server.endpoint, _record("stays"))
    leaves = EtcdRegistrar(etcd_server.endpoint, _record("leaves"))
    await stays.start()
    await leaves.start()
    await _until(lambda: _ids(watcher) == {"stays", "leaves"}, 5)

    etcd_server.stop()
    t0 = time.monotonic()
    await leaves.stop()  # its revoke cannot reach etcd: the lease must expire after the restart
    assert time.monotonic() - t0 < 5
    joins = EtcdRegistrar(etcd_server.endpoint, _record("joins"))
    joining = asyncio.create_task(joins.start(retry_for=30))  # a worker that comes up during the outage
    await asyncio.sleep(1.0)
    assert _ids(watcher) == {"stays", "leaves"}  # the last view is kept while etcd is down
    await asyncio.to_thread(etcd_server.start)  # same data dir and ports
    await asyncio.wait_for(joining, 10)

    # leases survive the restart with a fresh TTL; the dead one expires then
    await _until(lambda: _ids(watcher) == {"stays", "joins"}, 2 * TTL + 5)
    assert _kinds(changes, "leaves") == ["join", "leave"]
    assert _kinds(changes, "joins") == ["join"]
    # the survivor put its record again once etcd answered, under a live lease
    await _until(lambda: "update" in _kinds(changes, "stays"), 5)
    assert watcher.relists >= 1 and watcher.view.get("stays") is not None
    admin = EtcdClient(etcd_server.endpoint)
    assert await admin.keepalive(stays.lease_id) > 0
    _, kvs = await admin.range_prefix(WORKERS_PREFIX)
    assert sorted(kv.key for kv in kvs) == [WORKERS_PREFIX + "joins", WORKERS_PREFIX + "stays"]
    await admin.close()
    await joins.stop()
    await stays.stop()
    await watcher.stop()


class _Proxy:
    """A TCP relay to etcd that a test can cut (every connection dropped, new ones refused) and heal."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.black_hole = False  # while True, connections stay open but every byte is dropped

    async def open(self) -> None:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", self.port, reuse_address=True)

    async def cut(self) -> None:
        self._server.close()
        for w in list(self._writers):
            w.transport.abort()
        await self._server.wait_closed()

    async def _relay(self, reader, writer) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        pair = {writer, up_writer}
        self._writers |= pair

        async def pump(r, w):
            try:
                while data := await r.read(65536):
                    if not self.black_hole:
                        w.write(data)
                        await w.drain()
            except (OSError, ConnectionError):
                pass
            finally:
                w.close()

        await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))
        self._writers -= pair


async def test_watcher_cut_off_sees_joins_and_leaves_it_missed_after_reconnect(etcd_server):
    proxy = _Proxy(etcd_server.port)
    await proxy.open()
    changes = []
    watcher = EtcdWatcher(f"127.0.0.1:{proxy.port}", on_change=changes.append, retry_interval=0.2)
    await watcher.start()
    old = EtcdRegistrar(etcd_server.endpoint, _record("old"))
    await old.start()
    await _until(lambda: _ids(watcher) == {"old"}, 5)

    await proxy.cut()
    new = EtcdRegistrar(etcd_server.endpoint, _record("new"))
    await new.start()
    await old.stop()
    await asyncio.sleep(0.5)
    assert _ids(watcher) == {"old"}  # it really was cut off

    await proxy.open()
    await _until(lambda: _ids(watcher) == {"new"}, 5)
    assert _kinds(changes, "old") == ["join", "leave"] and _kinds(changes, "new") == ["join"]
    assert watcher.view.get("new") == new.record and watcher.relists >= 1
    # and it follows live changes again
    await new.set_status(WorkerStatus.DRAINING)
    await _until(lambda: watcher.view.get("new").status == WorkerStatus.DRAINING, 5)
    await new.stop()
    await watcher.stop()
    await proxy.cut()


async def test_watcher_behind_a_silent_half_open_link_finds_out_and_relists(etcd_server):
    proxy = _Proxy(etcd_server.port)
    await proxy.open()
    client = EtcdClient(f"127.0.0.1:{proxy.port}", timeout=1.0)
    watcher = EtcdWatcher(client, probe_interval=0.3, retry_interval=0.2)
    await watcher.start()
    proxy.black_hole = True  # no FIN, no RST: the watch stream just goes quiet
    reg = EtcdRegistrar(etcd_server.endpoint, _record("unseen"))
    await reg.start()
    await asyncio.sleep(2.0)  # the probe times out meanwhile
    assert len(watcher.view) == 0
    proxy.black_hole = False
    await _until(lambda: _ids(watcher) == {"unseen"}, 5)
    assert watcher.relists >= 1
    await reg.stop()
    await watcher.stop()
    await client.close()
    await proxy.cut()


async def test_a_bad_value_under_the_prefix_is_counted_and_skipped(etcd_server):
    watcher = EtcdWatcher(etcd_server.endpoint)
    await watcher.start()
    admin = EtcdClient(etcd_server.endpoint)
    await admin.put(WORKERS_PREFIX + "junk", b"not a record")
    await admin.put(WORKERS_PREFIX + "liar", _record("other").model_dump_json().encode())
    reg = EtcdRegistrar(etcd_server.endpoint, _record("good"))
    await reg.start()
    await _until(lambda: _ids(watcher) == {"good"}, 5)
    assert watcher.bad_records == 2
    await admin.close()
    await reg.stop()
    await watcher.stop()


async def test_discovery_for_switches_backend_with_the_flag(etcd_server):
    settings, _ = parse_cli(
        PlaneSettings, ["--discovery-backend", "etcd", "--etcd-endpoint", etcd_server.endpoint], prog="svc"
    )
    discovery = discovery_for(settings)  # no NATS needed
    watcher = discovery.watcher()
    await watcher.start()
    registrar = discovery.registrar(_record("w").model_copy(update={"discovery_backend": "nats"}))
    await registrar.start()
    await _until(lambda: watcher.view.get("w") is not None, 5)
    assert watcher.view.get("w").discovery_backend == "etcd"
    await registrar.stop()
    await watcher.stop()
    nats_settings, _ = parse_cli(PlaneSettings, [], prog="svc")
    with pytest.raises(ValueError, match="JetStream"):
        discovery_for(nats_settings).watcher()


async def test_nothing_listening_fails_at_once_naming_the_flag():
    endpoint = f"127.0.0.1:{free_port()}"
    # refused connections: no retry loop, no wait (a hang would end in pytest-timeout's failure)
    with pytest.raises(EtcdUnavailable, match=f"etcd at http://{endpoint} is unreachable .*--etcd-endpoint"):
        await EtcdWatcher(endpoint).start()
    with pytest.raises(EtcdUnavailable, match=f"etcd at http://{endpoint} is unreachable .*--etcd-endpoint"):
        await EtcdRegistrar(endpoint, _record("a")).start()


async def test_an_endpoint_that_never_answers_fails_after_the_client_timeout_naming_the_flag():
    with socket.socket() as silent:  # accepts connections (the kernel does) but never replies
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        endpoint = "127.0.0.1:%d" % silent.getsockname()[1]
        # the etcd client's own bound (3 s by default), not a hang
        with pytest.raises(EtcdUnavailable, match="no answer within 3s.*--etcd-endpoint"):
            await EtcdRegistrar(endpoint, _record("a")).start()
