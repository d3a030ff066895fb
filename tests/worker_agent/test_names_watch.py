"""The agent's second look at the engine's served names (a LoRA adapter loaded or unloaded at run time)."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

from infera_worker_agent.health import ModelCard
from infera_worker_agent.names_watch import NamesWatch, changed, merged


def test_only_a_change_of_aliases_or_adapters_of_the_same_model_is_registered():
    card = ModelCard("m", 4096, ("m-latest",), ("sql",))
    assert changed(card, ModelCard("m", 4096, ("m-latest",), ("sql",))) == {}
    assert changed(card, ModelCard("m", 4096, ("m-latest",), ("sql", "chat"))) == {"added": ["chat"], "removed": []}
    assert changed(card, ModelCard("m", 4096, (), ())) == {"added": [], "removed": ["m-latest", "sql"]}
    assert changed(ModelCard("m", None, (), ("sql", "chat")), ModelCard("m", None, (), ("chat", "sql"))) == {}
    # an adapter that became an alias: registered again, though no name is new
    assert changed(card, ModelCard("m", 4096, ("m-latest", "sql"), ())) == {"added": [], "removed": []}
    assert changed(card, ModelCard("other", 4096, (), ("x",))) == {}  # another model: not this record's


def test_an_engine_that_reloads_what_it_evicted_keeps_every_adapter_it_listed():
    old = ModelCard("m", 4096, (), ("sql", "chat"))
    assert merged(old, ModelCard("m", 4096, (), ("chat", "new"))) == ModelCard("m", 4096, (), ("sql", "chat", "new"))
    assert merged(old, ModelCard("m", 4096, ("sql",), ())) == ModelCard("m", 4096, ("sql",), ("chat",))
    assert changed(old, merged(old, ModelCard("m", 4096, (), ()))) == {}  # an eviction changes nothing


async def test_the_watch_registers_what_the_engine_lists_now_and_survives_a_bad_answer():
    listed: list[object] = [[{"id": "m"}]]

    async def models(_request):
        body = listed[-1]
        return web.json_response({"data": body}) if body is not None else web.Response(status=500)

    app = web.Application()
    app.router.add_get("/v1/models", models)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    url = str(server.make_url("")).rstrip("/")
    seen: list[ModelCard] = []

    async def on_change(card: ModelCard) -> None:
        seen.append(card)

    async with aiohttp.ClientSession() as session:
        watch = NamesWatch(session, url, 0.05, ModelCard("m"), on_change)
        assert not await watch.check_once()
        listed.append([{"id": "m"}, {"id": "sql", "parent": "m"}])
        assert await watch.check_once() and seen == [ModelCard("m", None, (), ("sql",))]
        listed.append(None)  # the engine answers 500 once: nothing changes
        assert not await watch.check_once()
        listed.append([{"id": "m"}])
        assert await watch.check_once() and seen[-1].adapters == ()
        assert watch.current == ModelCard("m")
        listed.append([{"id": "m"}, {"id": "late", "parent": "m"}])
        watch.start()  # the loop finds it on its own
        for _ in range(100):
            if seen[-1].adapters == ("late",):
                break
            await asyncio.sleep(0.05)
        await watch.stop()
        assert seen[-1].adapters == ("late",)
    await server.close()
