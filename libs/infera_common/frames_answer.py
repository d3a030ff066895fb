"""Answering a frontend about the response frames of requests a ``RequestRunner`` runs:
``FramesQuery`` (how many frames each request sent; asked after a broker outage, and about
requests silent for a while, where an answer shows the sender is still on the bus) and
``FramesReplay`` (send them again from a number on). Whoever sends the frames answers: the
worker-agent on ``--request-transport nats``, the router that calls the engine itself on ``http``.

``FramesAnswers`` holds no state of its own: it reads the runner's kept frames. A question that
cannot be read is counted ("bad") and logged, never answered and never fatal.
"""

from __future__ import annotations

from typing import Any

from nats.aio.msg import Msg

from infera_common.logs import get_logger
from infera_common.request_runner import RequestRunner, quietly
from infera_common.schemas import FramesQuery, FramesReplay, FramesReplayed, FramesSent, M, decode, encode

log = get_logger("frames_answer")


class FramesAnswers:
    """``queries`` and ``replays``: Prometheus counters with an ``outcome`` label."""

    def __init__(self, runner: RequestRunner, queries: Any, replays: Any) -> None:
        self._runner = runner
        self._queries = queries
        self._replays = replays

    async def on_query(self, msg: Msg, worker_id: str | None = None) -> None:
        """Answer with the frames sent by each asked request this runner knows (others are left
        out: never received). ``worker_id``: the answerer's own worker, else the question's."""
        query = self._decoded(msg, FramesQuery, self._queries)
        if query is None or (worker := self._worker(query.worker_id, worker_id, self._queries)) is None:
            return
        sent = {rid: n for rid in query.request_ids if (n := self._runner.frames_sent(worker, rid)) is not None}
        self._queries.labels("answered").inc()
        await quietly(msg.respond(encode(FramesSent(sent=sent))), "frames_reply")

    async def on_replay(self, msg: Msg, worker_id: str | None = None) -> None:
        """Send the asked frames again (they go out before the answer), or answer -1."""
        ask = self._decoded(msg, FramesReplay, self._replays)
        if ask is None or (worker := self._worker(ask.worker_id, worker_id, self._replays)) is None:
            return
        count = await self._runner.replay(worker, ask.request_id, ask.from_seq)
        self._replays.labels("sent" if count >= 0 else "not_kept").inc()
        log.info("frames_replayed", request_id=ask.request_id, worker_id=worker, from_seq=ask.from_seq, count=count)
        await quietly(msg.respond(encode(FramesReplayed(count=count))), "replay_reply")

    @staticmethod
    def _worker(asked: str | None, own: str | None, outcomes: Any) -> str | None:
        if own is not None:
            return own
        if asked is None:  # a router runs requests of many workers: without it, every request looks lost
            outcomes.labels("bad").inc()
            log.warning("bad_question", error="no worker_id: a router cannot tell which requests are meant")
        return asked

    @staticmethod
    def _decoded(msg: Msg, cls: type[M], outcomes: Any) -> M | None:
        try:
            return decode(cls, msg.data)
        except ValueError as exc:
            outcomes.labels("bad").inc()
            log.warning("bad_question", kind=cls.__name__, error=str(exc)[:500])
            return None
