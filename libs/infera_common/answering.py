"""Past a silent replica: the first replica that says it is there, for a while after a request went
unanswered.

A queue group (the routers', the kv-indexers') hands each request to any subscribed member, a frozen
one (SIGSTOP, a hung host) included, until nats-server drops it for missing its pings (20-30 s):
each request it takes goes unanswered until the caller's timeout. After one has, the caller asks
the replicas' ping subject (every member subscribes, no queue group; each answers its id) and
sends to the first that answers, on that member's own subject, and keeps doing so for
``WARY_FOR`` seconds (``Wary``, pure). Members from before the ping answer nothing ("no
responders"), and the caller uses the queue group as before.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from infera_common.subjects import TOKEN_RE

#: Seconds after a request went unanswered during which requests go to a member that answers.
WARY_FOR = 30.0


class Wary:
    """Until when requests avoid the queue group (``now``: the caller's monotonic clock)."""

    __slots__ = ("wary_for", "_until")

    def __init__(self, wary_for: float = WARY_FOR) -> None:
        self.wary_for = wary_for
        self._until = float("-inf")

    def silence(self, now: float) -> None:
        """A request went unanswered at ``now``."""
        self._until = now + self.wary_for

    def active(self, now: float) -> bool:
        return now < self._until


async def first_to_answer(nc, subject: str, timeout: float) -> str | None:  # noqa: ANN001 - a NATS client
    """The id of the first member to answer a ping on ``subject`` (None: none within ``timeout``,
    nobody subscribed, an id that is not a subject token, or this connection in trouble)."""
    try:
        msg = await nc.request(subject, b"", timeout=timeout)
        member = msg.data.decode()
    except Exception:
        return None
    return member if TOKEN_RE.match(member) else None


def ping_answerer(member_id: str) -> Callable[[object], Awaitable[None]]:
    """A member's subscription callback for its ping subject: it answers with ``member_id``."""
    answer = member_id.encode()

    async def on_ping(msg) -> None:  # noqa: ANN001 - a NATS message
        if msg.reply:
            await msg.respond(answer)
    return on_ping
