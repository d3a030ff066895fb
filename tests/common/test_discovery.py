import asyncio
import time

from infera_common.discovery import Registrar, Watcher
from infera_common.fleet import FleetView
from infera_common.nats_conn import connect
from infera_common.schemas import WorkerRecord, WorkerStatus
from infera_common.subjects import DISCOVERY_BUCKET


def _record(wid: str, ttl: float = 1.5, **kw) -> WorkerRecord:
    return WorkerRecord(worker_id=wid, model="m", engine="mock", url="http://127.0.0.1:1",
                        advertise_host="127.0.0.1", ttl=ttl, **kw)


def test_fleet_view_expires_by_record_ttl():
    view = FleetView()
    now_w = time.time()
    assert view.put(_record("a", ttl=2.0, status=WorkerStatus.ACTIVE), 100.0, now_w).kind == "join"
    assert view.put(_record("a", ttl=2.0, status=WorkerStatus.ACTIVE), 101.0, now_w).kind == "update"
    assert view.models() == ["m"]
    assert view.expire(102.9) == []
    gone = view.expire(103.0)
    assert [c.record.worker_id for c in gone] == ["a"] and len(view) == 0


def test_fleet_view_a_record_seen_first_long_after_its_heartbeat_gets_half_its_ttl():
    """A watcher's first snapshot may hold the entry of an agent killed a minute ago, or a live
    agent's whose host clock is a minute behind: both get half a TTL, in which the live one beats
    again (every ttl/3) and the dead one does not."""
    view = FleetView()
    now = time.time()
    dead = _record("dead", ttl=6.0).model_copy(update={"heartbeat_at": now - 60})
    skewed = _record("skewed", ttl=6.0).model_copy(update={"heartbeat_at": now - 60})
    fresh = _record("fresh", ttl=6.0).model_copy(update={"heartbeat_at": now - 1})
    for rec in (dead, skewed, fresh):
        view.put(rec, 50.0, now)
    assert view.expire(52.9) == []
    view.put(skewed.model_copy(update={"heartbeat_at": now - 60 + 2}), 52.0, now + 2)  # its next heartbeat
    assert [c.record.worker_id for c in view.expire(53.0)] == ["dead"]
    assert view.expire(55.0 - 0.01) == [] and [c.record.worker_id for c in view.expire(55.0)] == ["fresh"]
    assert [c.record.worker_id for c in view.expire(58.0)] == ["skewed"]  # a full ttl after its last beat


def test_fleet_view_a_worker_whose_clock_is_behind_stays_listed_between_heartbeats():
    """Read against this host's clock, every heartbeat of an agent 10 s behind looked 10 s old, and
    the worker was dropped right after each one."""
    view = FleetView()
    t = time.time()
    for beat in range(6):  # a heartbeat every 2 s (ttl/3), its host clock 10 s behind
        now_mono, now_wall = 100.0 + 2 * beat, t + 2 * beat
        view.put(_record("a", ttl=6.0).model_copy(update={"heartbeat_at": now_wall - 10}), now_mono, now_wall)
        assert view.expire(now_mono + 1.99) == [] and view.get("a") is not None
    assert view.expire(110.0 + 6.0) != []  # silent for a ttl after its last heartbeat: gone


def test_fleet_view_a_heartbeat_read_late_still_counts_its_delay():
    """What the clocks' offset does not explain is age: a watcher stalled for 5 s finds a heartbeat
    of a skewed worker 5 s older than its clock offset says, and gives it the rest of its ttl only."""
    view = FleetView()
    t = time.time()
    for beat in range(3):
        view.put(_record("a", ttl=6.0).model_copy(update={"heartbeat_at": t + 2 * beat + 30}), 100.0 + 2 * beat,
                 t + 2 * beat)  # this worker's clock 30 s ahead
    view.put(_record("a", ttl=6.0).model_copy(update={"heartbeat_at": t + 6 + 30}), 111.0, t + 11)  # read 5 s late
    assert view.expire(111.9) == [] and [c.record.worker_id for c in view.expire(112.0)] == ["a"]


def test_fleet_view_says_how_far_a_workers_clock_is_from_the_least_late_of_its_heartbeats():
    """What a reader of a time the worker stamped (a KV relay's) takes off: its clock 30 s ahead and
    the fastest of its last heartbeats 0.01 s on the way gives -29.99; a worker gone has none."""
    view = FleetView()
    assert view.clock_offset("a") is None
    t = time.time()
    for beat, transit in enumerate((0.5, 0.01, 0.2)):
        view.put(_record("a", ttl=6.0).model_copy(update={"heartbeat_at": t + 2 * beat + 30}), 100.0 + 2 * beat,
                 t + 2 * beat + transit)
    assert abs(view.clock_offset("a") - (0.01 - 30)) < 1e-6
    view.delete("a")
    assert view.clock_offset("a") is None


def test_draining_worker_is_known_but_not_active():
    view = FleetView()
    view.put(_record("a", status=WorkerStatus.DRAINING), 1.0, time.time())
    assert view.models() == [] and view.known_model("m") and view.active("m") == []


async def test_register_watch_deregister_and_age_out(nats_server):
    nc = await connect(nats_server, "t")
    js = nc.jetstream()
    changes = []
    watcher = Watcher(js, on_change=changes.append, sweep_interval=0.05)
    await watcher.start()
    reg_a = Registrar(js, _record("a", status=WorkerStatus.ACTIVE))
    reg_b = Registrar(js, _record("b", status=WorkerStatus.ACTIVE))
    await reg_a.start()
    await reg_b.start()
    for _ in range(100):
        if len(watcher.view) == 2:
            break
        await asyncio.sleep(0.02)
    assert {r.worker_id for r in watcher.view.workers()} == {"a", "b"}
    # heartbeats keep "a" alive past its ttl
    await asyncio.sleep(2.0)
    assert watcher.view.get("a") is not None
    # an explicit deregistration is seen at once
    await reg_a.stop()
    await asyncio.sleep(0.2)
    assert watcher.view.get("a") is None
    # a registrant that stops beating (crash) ages out within its ttl
    reg_b._task.cancel()
    t0 = time.monotonic()
    while watcher.view.get("b") is not None and time.monotonic() - t0 < 5:
        await asyncio.sleep(0.05)
    assert watcher.view.get("b") is None
    assert time.monotonic() - t0 <= 1.5 + 0.5
    assert [c.kind for c in changes if c.record.worker_id == "b"][-1] == "leave"
    await watcher.stop()
    await nc.close()


async def test_a_lost_bucket_is_recreated_rewatched_and_refilled_by_restore(nats_server):
    """What a restarted broker does to discovery (the bucket is in memory), without the restart."""
    nc = await connect(nats_server, "t")
    js = nc.jetstream()
    watcher = Watcher(js, sweep_interval=0.05)
    await watcher.start()
    reg = Registrar(js, _record("a", ttl=30.0, status=WorkerStatus.ACTIVE))
    await reg.start()
    for _ in range(100):
        if watcher.view.get("a") is not None:
            break
        await asyncio.sleep(0.02)
    await watcher.restore()  # the same bucket: nothing to do, the watch goes on
    await js.delete_key_value(DISCOVERY_BUCKET)  # gone with every record, as after a broker restart
    await watcher.restore()  # a new (empty) bucket, watched from its start
    await reg.restore()  # the record put back at once
    await reg.set_status(WorkerStatus.DRAINING)  # and what follows is seen by the new watch
    for _ in range(100):
        if (r := watcher.view.get("a")) is not None and r.status == WorkerStatus.DRAINING:
            break
        await asyncio.sleep(0.02)
    assert watcher.view.get("a").status == WorkerStatus.DRAINING
    await reg.stop()
    await watcher.stop()
    await nc.close()


def test_a_sweep_that_woke_past_its_interval_is_late():
    from infera_common.discovery import late_sweep
    assert not late_sweep(10.0, 10.3, 0.25)  # an ordinary wake-up
    assert late_sweep(10.0, 11.0, 0.25)  # the loop was held a second
    assert not late_sweep(10.0, 11.0, 2.0) and late_sweep(10.0, 12.5, 2.0)


async def test_a_watcher_whose_loop_stalled_past_the_ttl_keeps_the_workers_that_beat_meanwhile(nats_server):
    """The agents live in other processes and kept beating; this one's loop was held (a long
    synchronous step): their heartbeats wait unread, and ageing them out would empty its fleet."""
    import threading

    beating = threading.Event()
    stop = threading.Event()

    def agent() -> None:  # another process's loop: its own thread, loop and connection
        async def run() -> None:
            nc = await connect(nats_server, "agent")
            reg = Registrar(nc.jetstream(), _record("a", ttl=1.5, status=WorkerStatus.ACTIVE))
            await reg.start()
            beating.set()
            while not stop.is_set():
                await asyncio.sleep(0.05)
            await reg.stop()
            await nc.close()
        asyncio.run(run())

    thread = threading.Thread(target=agent)
    thread.start()
    nc = await connect(nats_server, "t")
    changes = []
    watcher = Watcher(nc.jetstream(), on_change=changes.append, sweep_interval=0.05)
    try:
        await watcher.start()
        assert await asyncio.to_thread(beating.wait, 10)
        for _ in range(100):
            if watcher.view.get("a") is not None:
                break
            await asyncio.sleep(0.02)
        time.sleep(3.0)  # this loop stalls for twice the TTL
        await asyncio.sleep(0.5)
        assert watcher.view.get("a") is not None
        assert [c.kind for c in changes if c.record.worker_id == "a"].count("leave") == 0
    finally:
        stop.set()
        await asyncio.to_thread(thread.join, 10)
        await watcher.stop()
        await nc.close()
