"""A router subscribed to the route subject but not answering (frozen by SIGSTOP, a hung host, a
loop stuck) is handed its share of the route requests by the broker's queue group."""

from __future__ import annotations

import time

import aiohttp

from tests.frontend.frontend_fakes import W1, chat_body, completion_json, url


async def test_a_route_request_no_router_answers_in_time_is_tried_again_through_the_queue_group(
        start_frontend, multi):
    """A router that is subscribed but stalled (frozen, or hung) takes its share of the route
    requests and answers none: the frontend tries again after --route-timeout, and the request says
    until when it was waited for, so that the stalled router, when it wakes, drops it unplaced."""
    fe = await start_frontend(route_timeout=0.5)
    multi.stalled = 1
    before = time.time()
    async with aiohttp.ClientSession() as s, s.post(url(fe, "/v1/chat/completions"), json=chat_body()) as r:
        assert r.status == 200 and await r.read() == completion_json()
    first, second = multi.routed
    assert before + 0.5 <= first.route_deadline <= second.route_deadline - 0.5  # each attempt its own
    # the stalled router may have handed the first over before it stalled: the retry is another
    # request on the worker (the same id was refused 409 "already running" by a worker holding both)
    assert second.request_id == first.request_id + "-1"
    assert multi.placed == [W1]
    assert fe.metrics.registry.get_sample_value("infera_frontend_retries_total", {"reason": "route_timeout"}) == 1


async def test_a_retry_after_a_route_timeout_goes_to_a_router_that_says_it_is_there(start_frontend, multi):
    """Two routers, one frozen: through the queue group the retry went to the frozen one again half
    the time, and the request failed after two route timeouts. The retry goes to the first router
    that answers the ping, on that router's own subject."""
    fe = await start_frontend(route_timeout=0.5)
    await multi.serve_directly("r2")
    multi.stalled = 2  # the queue group would hand the frozen router the retry too
    async with aiohttp.ClientSession() as s, s.post(url(fe, "/v1/chat/completions"), json=chat_body()) as r:
        assert r.status == 200 and await r.read() == completion_json()
    first, second = multi.routed
    assert multi.direct == [second.request_id] == [first.request_id + "-1"]
    assert multi.stalled == 1 and multi.placed == [W1]  # the queue group was not asked again
    # for a while the other requests go to a router that answers too: the queue group would hand
    # the silent router its share of them, each waiting out the route timeout
    async with aiohttp.ClientSession() as s, s.post(url(fe, "/v1/chat/completions"), json=chat_body()) as r:
        assert r.status == 200
    assert len(multi.direct) == 2 and multi.stalled == 1
    registry = fe.metrics.registry
    assert registry.get_sample_value("infera_frontend_retries_total", {"reason": "route_timeout"}) == 1
    assert registry.get_sample_value("infera_frontend_routes_direct_total") == 2
