"""API keys on both sides of Infera: clients present one to the frontend (--api-key), and engines
started with their own --api-key get theirs from the worker-agent (NATS plane) or from the router
that calls them (--engine-api-key, no-broker plane). No key appears in any log."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest

from infera_common.models import BUNDLED_MODEL_NAME
from tests.e2e.fleet import PLANES, Fleet, env_with

CLIENT_KEY, ENGINE_KEY = "sk-client-5f2a", "sk-engine-9c41"
CHAT = {"model": BUNDLED_MODEL_NAME, "messages": [{"role": "user", "content": "1+1=?"}], "max_tokens": 4}


def get(url: str, key: str | None = None) -> tuple[int, dict]:
    ask = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(ask, timeout=5) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as err:
        return err.code, json.load(err)


@pytest.mark.parametrize("plane", list(PLANES))
def test_clients_and_engines_each_get_their_key(tmp_path, plane):
    # the client key as infera up's flag on one plane, in its environment on the other
    by_flag = plane == "nats"
    env = env_with(INFERA_ENGINE_API_KEY=ENGINE_KEY, **({} if by_flag else {"INFERA_API_KEY": CLIENT_KEY}))
    fleet = Fleet(tmp_path, workers=1, plane=plane, env=env,
                  extra=[f"--engine-arg=--speedup 20 --api-key {ENGINE_KEY}",
                         *(["--api-key", CLIENT_KEY] if by_flag else [])]).start()
    try:
        assert 'Bearer ${INFERA_API_KEY%%,*}' in fleet.banner and CLIENT_KEY not in fleet.banner
        client = openai.OpenAI(base_url=fleet.url + "/v1", api_key=CLIENT_KEY, max_retries=0)
        reply = client.chat.completions.create(**CHAT)
        assert reply.usage.prompt_tokens == 35
        stream = client.chat.completions.create(**CHAT, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=fleet.url + "/v1", api_key="sk-guess", max_retries=0).models.list()
        status, listing = get(fleet.url + "/v1/workers", CLIENT_KEY)
        [worker] = listing["data"]
        assert status == 200 and worker["engine_api_key"] is True
        assert get(worker["url"] + "/v1/models")[0] == 401  # the engine itself is closed to keyless callers
        assert get(worker["url"] + "/v1/models", ENGINE_KEY)[0] == 200
    finally:
        fleet.stop()
    for log in (tmp_path / "logs").glob("*.log"):
        text = log.read_text(errors="replace")
        assert CLIENT_KEY not in text and ENGINE_KEY not in text, log.name


def test_a_router_without_the_engines_key_says_which_flag_to_give(tmp_path):
    fleet = Fleet(tmp_path, workers=1, plane="no-broker",
                  extra=[f"--engine-arg=--speedup 20 --api-key {ENGINE_KEY}"]).start()
    try:
        client = openai.OpenAI(base_url=fleet.url + "/v1", api_key="-", max_retries=0)
        with pytest.raises(openai.APIStatusError) as failed:
            client.chat.completions.create(**CHAT)
        assert failed.value.status_code == 502 and "--engine-api-key" in failed.value.message
    finally:
        fleet.stop()
    assert "worker_engine_key_missing" in (tmp_path / "logs" / "server.log").read_text()
