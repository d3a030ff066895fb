"""Attempts whose engine refused the connection ran nowhere: the frontend retries them on other
workers without spending --request-max-retries (a mass loss of workers still listed in discovery)."""

import pytest

from infera_common.schemas import Frame
from tests.frontend.frontend_fakes import W1, W2, W3, chat_body
from tests.frontend.test_frontend_failover import agent_error, metrics_text, post


@pytest.mark.parametrize("stream", [False, True])
async def test_attempts_whose_engine_was_never_reached_are_retried_without_spending_the_retries(
        start_frontend, multi, stream, capsys):
    """Workers that died moments ago are still listed until their discovery entry ages out: a
    request may meet several in a row. Nothing of it ran on them, so each is retried on the next
    worker, even with --request-max-retries 0; the client sees the answer, and a warning is logged
    for what it cannot get."""
    fe = await start_frontend(request_max_retries=0)
    refused = Frame(kind="error", status=502, message="the engine could not be reached", unreached=True)

    async def gone(f, req):
        await f.frame(req, refused)

    multi.scripts[W1] = multi.scripts[W2] = gone
    status, _, raw = await post(fe, chat_body(stream=stream))
    assert status == 200 and multi.placed == [W1, W2, W3]
    assert [r.exclude for r in multi.routed] == [[], [W1], [W1, W2]]
    assert 'infera_frontend_retries_total{reason="worker_unreachable"} 2.0' in await metrics_text(fe)
    # an ordinary 502 (the engine may have run it) still gets only --request-max-retries
    multi.routed.clear(), multi.placed.clear()
    multi.scripts[W1] = agent_error(502, "the engine's connection broke")
    status, _, _ = await post(fe, chat_body(stream=stream))
    assert status == 502 and multi.placed == [W1]
    assert "request_failed_upstream" in capsys.readouterr().out  # what the client got, logged
