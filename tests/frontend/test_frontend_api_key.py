"""--api-key: HTTP clients without one of the keys get OpenAI's 401, and reach nothing behind it."""

from __future__ import annotations

import aiohttp
import pytest

from infera_common.settings import parse_cli
from infera_frontend.auth import refusal, digests
from infera_frontend.settings import FrontendSettings
from tests.frontend.frontend_fakes import MODEL, chat_body, url, wait_until

KEYS = ["sk-old-1", "sk-new-2"]


def test_keys_come_from_repeated_flags_or_one_comma_separated_variable(monkeypatch):
    monkeypatch.setenv("INFERA_API_KEY", " sk-a , sk-b,")
    settings, _ = parse_cli(FrontendSettings, [], prog="infera-frontend")
    assert settings.api_keys() == ["sk-a", "sk-b"] and "sk-a" not in repr(settings)
    settings, _ = parse_cli(FrontendSettings, ["--api-key", "k1", "--api-key", "k2"], prog="infera-frontend")
    assert settings.api_keys() == ["k1", "k2"]
    monkeypatch.setenv("INFERA_API_KEY", "")  # set but empty (compose's default): no key asked
    assert parse_cli(FrontendSettings, [], prog="infera-frontend")[0].api_keys() == []
    monkeypatch.delenv("INFERA_API_KEY")
    assert parse_cli(FrontendSettings, [], prog="infera-frontend")[0].api_keys() == []
    # an empty key (an unset shell variable) would leave the API open: refused, as is a comma in one
    for argv in (["--api-key", ""], ["--api-key", "k1", "--api-key", " "], ["--api-key", "a,b"]):
        with pytest.raises(SystemExit):
            parse_cli(FrontendSettings, argv, prog="infera-frontend")
    monkeypatch.setenv("INFERA_API_KEY", " , ")
    with pytest.raises(SystemExit):
        parse_cli(FrontendSettings, [], prog="infera-frontend")


def test_a_key_is_a_bearer_token_of_the_ones_given():
    accepted = digests(KEYS)
    assert refusal("Bearer sk-new-2", accepted) is None and refusal("bearer sk-old-1", accepted) is None
    assert refusal(None, accepted).startswith("Missing API key")
    assert refusal("sk-old-1", accepted).startswith("The Authorization header")
    assert refusal("Basic sk-old-1", accepted).startswith("The Authorization header")
    assert refusal("Bearer sk-old", accepted) == "Incorrect API key provided."
    assert refusal("Bearer sk-\udcff\udcfe", accepted) == "Incorrect API key provided."  # bytes not UTF-8


async def get(fe, path: str, headers: dict | None = None) -> tuple[int, dict, dict | str]:
    async with aiohttp.ClientSession() as s, s.get(url(fe, path), headers=headers) as r:
        body = await r.json() if r.content_type == "application/json" else await r.text()
        return r.status, dict(r.headers), body


async def test_requests_without_a_key_are_refused_before_they_reach_the_router(make_frontend, fleet):
    fe = await make_frontend(api_key=KEYS)
    await wait_until(lambda: fe.models.is_known(MODEL))
    async with aiohttp.ClientSession() as s:
        for headers in (None, {"Authorization": "Bearer sk-guess"}):
            async with s.post(url(fe, "/v1/chat/completions"), json=chat_body(), headers=headers) as r:
                assert r.status == 401 and r.headers["WWW-Authenticate"] == "Bearer"
                err = (await r.json())["error"]
                assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error"
                assert "sk-guess" not in err["message"]
        for path in ("/v1/models", "/v1/workers", "/v1/no-such-route"):  # listings too; no route is told apart
            assert (await get(fe, path))[0] == 401
        async with s.options(url(fe, "/v1/chat/completions")) as r:  # nor its methods
            assert r.status == 401
        async with s.get(url(fe, "/v1/models"), headers={"Authorization": "Bearer sk-\xff\xfe"}) as r:
            assert r.status == 401 and (await r.json())["error"]["code"] == "invalid_api_key"
        assert fleet.routed == []
        for key in KEYS:  # either key: one can be replaced while clients move to the other
            async with s.post(url(fe, "/v1/chat/completions"), json=chat_body(),
                              headers={"Authorization": f"Bearer {key}"}) as r:
                assert r.status == 200
    assert len(fleet.routed) == 2
    for path in ("/health", "/ready", "/metrics"):  # probes and Prometheus carry no secret
        assert (await get(fe, path))[0] == 200
    status, _, text = await get(fe, "/metrics")
    assert "infera_frontend_unauthorized_requests_total 7.0" in text


async def test_the_openai_sdk_sends_its_key(make_frontend, fleet):
    openai = pytest.importorskip("openai")
    fe = await make_frontend(api_key=KEYS[:1])
    await wait_until(lambda: fe.models.is_known(MODEL))
    good = openai.AsyncOpenAI(base_url=url(fe, "/v1"), api_key=KEYS[0], max_retries=0)
    bad = openai.AsyncOpenAI(base_url=url(fe, "/v1"), api_key="sk-wrong", max_retries=0)
    try:
        reply = await good.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "1+1=?"}])
        assert reply.choices[0].message.content == "2"
        with pytest.raises(openai.AuthenticationError) as refused:
            await bad.models.list()
        assert refused.value.code == "invalid_api_key"
    finally:
        await good.close()
        await bad.close()
