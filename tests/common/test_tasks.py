"""Background tasks stop when asked, even when one cancellation is lost on the way."""

from __future__ import annotations

import asyncio

from nats.js.errors import KeyNotFoundError

from infera_common.discovery import Registrar
from infera_common.schemas import WorkerRecord, WorkerStatus
from infera_common.tasks import stop_tasks


async def _loop_losing_first_cancel(turns: list[int]) -> None:
    """A loop that, like a heartbeat on Python 3.11, swallows the first cancellation it gets."""
    lost = False
    while True:
        try:
            await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            if lost:
                raise
            lost = True  # what 3.11's wait_for does when its inner future is already done
        turns.append(1)


async def test_stop_tasks_returns_once_a_task_that_lost_its_cancellation_has_stopped():
    turns: list[int] = []
    task = asyncio.create_task(_loop_losing_first_cancel(turns))
    await asyncio.sleep(0.05)
    plain = asyncio.create_task(asyncio.sleep(60))
    await asyncio.wait_for(stop_tasks(task, None, plain), 5)
    assert task.done() and plain.done()
    ran = len(turns)
    await asyncio.sleep(0.05)
    assert len(turns) == ran  # it really stopped, not just stopped being waited for


async def test_stop_tasks_does_not_raise_the_exception_of_a_task_that_failed():
    async def fail() -> None:
        raise RuntimeError("boom")

    failed = asyncio.create_task(fail())
    await asyncio.sleep(0)
    await stop_tasks(failed)  # does not raise; the exception counts as retrieved
    assert failed.done() and isinstance(failed.exception(), RuntimeError)


async def test_stop_tasks_gives_up_on_a_task_that_never_stops():
    release = asyncio.Event()

    async def stubborn() -> None:
        while not release.is_set():
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                pass

    task = asyncio.create_task(stubborn())
    await asyncio.wait_for(stop_tasks(task, give_up_after=0.3), 5)
    assert not task.done()  # reported and left running, not waited for forever
    release.set()
    await task


class _AckedAsCancelledKv:
    """A discovery bucket whose heartbeat put is acknowledged in the very step the registrar is
    stopped: on Python 3.11 nats-py's ``wait_for`` then loses the cancellation."""

    def __init__(self) -> None:
        self.puts = 0
        self.deleted: list[str] = []
        self.pending: asyncio.Future | None = None

    async def get(self, key: str):
        raise KeyNotFoundError  # nobody holds the id

    async def create(self, key: str, value: bytes) -> int:
        self.puts += 1
        return 1  # the claim of start()

    async def put(self, key: str, value: bytes) -> int:
        self.puts += 1
        self.pending = asyncio.get_running_loop().create_future()
        return await asyncio.wait_for(self.pending, 5)

    async def delete(self, key: str) -> None:
        self.deleted.append(key)


async def test_a_registrar_stopped_as_its_heartbeat_is_acknowledged_stops_and_deletes_its_record(monkeypatch):
    kv = _AckedAsCancelledKv()

    async def bucket(js):
        return kv

    monkeypatch.setattr("infera_common.discovery.open_bucket", bucket)
    record = WorkerRecord(worker_id="w1", model="m", engine="mock", url="http://127.0.0.1:1",
                          advertise_host="127.0.0.1", status=WorkerStatus.ACTIVE, ttl=0.03)
    registrar = Registrar(js=None, record=record)
    await registrar.start()
    while kv.pending is None:  # the heartbeat is waiting for the broker's answer
        await asyncio.sleep(0.001)
    kv.pending.set_result(1)  # the answer arrives...
    await asyncio.wait_for(registrar.stop(), 5)  # ...as the agent leaves: no beat may follow
    puts = kv.puts
    await asyncio.sleep(0.1)  # three heartbeat intervals
    assert kv.puts == puts and kv.deleted == ["w1"]
