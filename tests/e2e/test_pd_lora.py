"""A LoRA adapter through a disaggregated pair (SGLang's bootstrap protocol): both legs are sent the
adapter in SGLang's own syntax, and the client gets the answer under the adapter's name."""

from __future__ import annotations

import pytest

from infera_common.models import BUNDLED_MODEL_NAME
from tests.e2e.fleet import Fleet, env_with
from tests.e2e.test_lora import _cached
from tests.e2e.runbook import http_json

PROMPT = "a question for the adapter through the pair, long enough for several KV blocks " * 12


@pytest.mark.parametrize("plane", ["nats", "no-broker"])
def test_an_adapter_request_crosses_the_pair_and_is_answered_under_the_adapters_name(tmp_path, plane):
    fleet = Fleet(tmp_path, workers=0, plane=plane,
                  extra=["--prefill-workers", "1", "--decode-workers", "1", "--pd-protocol", "sglang-bootstrap",
                         "--engine-arg=--speedup 20 --lora-paths sql=/adapters/sql"],
                  env=env_with()).start()
    try:
        assert [w["adapters"] for w in fleet.workers_list()] == [["sql"], ["sql"]]

        def chat(model: str) -> dict:
            status, body = http_json(fleet.url + "/v1/chat/completions", {
                "model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4})
            assert status == 200, body
            return body

        first, again = chat("sql"), chat(f"{BUNDLED_MODEL_NAME}:sql")  # the adapter alone, then SGLang's form
        assert first["model"] == again["model"] == "sql"  # not the "<model>:sql" the engines were sent
        assert _cached(first) == 0 and _cached(again) > 0  # the prefill engine's blocks under the adapter
        base = chat(BUNDLED_MODEL_NAME)
        assert base["model"] == BUNDLED_MODEL_NAME and _cached(base) == 0  # the adapter ran: its blocks are its own
    finally:
        fleet.stop()
