"""OpenTelemetry spans of one request, from real processes: a fleet started by `infera up
--otlp-traces-endpoint` pointing at an OTLP/HTTP receiver in this test, which decodes what the
services export. The client's W3C traceparent must come back as one trace: the frontend's server
span under the client's span, the router's route span under it, the engine call under that, and the
kv-indexer's answer under the router's query."""

from __future__ import annotations

import json
import secrets
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import aiohttp
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from infera_common.models import BUNDLED_MODEL_NAME
from tests.e2e.fleet import PLANES, Fleet, env_with


class Receiver:
    """An OTLP/HTTP traces endpoint: every exported span as (service, name, trace, span, parent, attributes)."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                export = ExportTraceServiceRequest()
                export.ParseFromString(self.rfile.read(int(self.headers["Content-Length"])))
                for rs in export.resource_spans:
                    service = next(a.value.string_value for a in rs.resource.attributes if a.key == "service.name")
                    for scope in rs.scope_spans:
                        for s in scope.spans:
                            receiver.spans.append({
                                "service": service, "name": s.name, "trace": s.trace_id.hex(), "span": s.span_id.hex(),
                                "parent": s.parent_span_id.hex(), "error": s.status.code == 2,
                                "attributes": {a.key: getattr(a.value, a.value.WhichOneof("value")) for a in s.attributes},
                            })
                body = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def trace(self, trace_id: str, want: int, timeout: float = 20.0) -> list[dict]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = [s for s in self.spans if s["trace"] == trace_id]
            if len(got) >= want:
                return got
            time.sleep(0.1)
        return [s for s in self.spans if s["trace"] == trace_id]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


#: A prompt of more than one KV block (64 tokens): the router asks the kv-indexer about it.
LONG = "Tell me everything you know about the sea and its tides. " * 12


@pytest.fixture(scope="module", params=list(PLANES))
def traced(tmp_path_factory, request):
    receiver = Receiver()
    fleet = Fleet(tmp_path_factory.mktemp("traced"), workers=1, plane=request.param,
                  extra=["--engine-arg=--speedup 20", f"--otlp-traces-endpoint={receiver.url}"],
                  env=env_with(OTEL_BSP_SCHEDULE_DELAY="100")).start()
    yield fleet, receiver
    fleet.stop()
    receiver.close()


async def post(fleet: Fleet, body: dict, headers: dict[str, str]) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as s, s.post(fleet.url + "/v1/chat/completions", json=body,
                                                    headers=headers) as r:
        return r.status, await r.read()


async def test_one_request_is_one_trace_under_the_clients_span(traced):
    fleet, receiver = traced
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    body = {"model": BUNDLED_MODEL_NAME, "messages": [{"role": "user", "content": LONG}], "max_tokens": 4,
            "stream": True}
    status, raw = await post(fleet, body, {"traceparent": f"00-{trace_id}-{client_span}-01", "X-Request-Id": "tr-1"})
    assert status == 200 and raw.endswith(b"data: [DONE]\n\n"), raw
    spans = receiver.trace(trace_id, 5)
    by_name = {s["name"]: s for s in spans}
    assert set(by_name) == {"POST /v1/chat/completions", "route", "kv query", "kv overlap query",
                            "engine POST /v1/chat/completions"}, spans
    front, route, engine = (by_name[n] for n in ("POST /v1/chat/completions", "route",
                                                 "engine POST /v1/chat/completions"))
    assert front["parent"] == client_span
    assert route["parent"] == front["span"]
    assert engine["parent"] == route["span"] and by_name["kv query"]["parent"] == route["span"]
    assert by_name["kv query"]["attributes"]["infera.kv.ok"] is True
    indexer = by_name["kv overlap query"]  # the kv-indexer's side of the round trip, in the same trace
    assert indexer["parent"] == by_name["kv query"]["span"]
    assert indexer["attributes"]["infera.outcome"] == "ok" and indexer["attributes"]["infera.model"] == BUNDLED_MODEL_NAME
    assert front["attributes"]["infera.request_id"] == "tr-1" and front["attributes"]["http.response.status_code"] == 200
    assert route["attributes"]["infera.worker_id"] == engine_worker(fleet)
    assert engine["attributes"]["infera.outcome"] == "ok" and not any(s["error"] for s in spans)
    if fleet.plane == "nats":  # three processes, each exporting its own span
        assert [s["service"] for s in (front, route, indexer, engine)] == [
            "infera-frontend", "infera-router", "infera-kv-indexer", "infera-worker-agent"]
    else:  # infera.server holds frontend, router and kv-indexer and calls the engine itself
        assert {front["service"], route["service"], indexer["service"], engine["service"]} == {"infera-server"}


async def test_a_request_without_a_traceparent_starts_its_own_trace_and_a_bad_one_is_ignored(traced):
    fleet, receiver = traced
    body = {"model": BUNDLED_MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    status, raw = await post(fleet, body, {"traceparent": "00-not-a-trace-01", "X-Request-Id": "tr-2"})
    assert status == 200, raw
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        fronts = [s for s in receiver.spans if s["attributes"].get("infera.request_id") == "tr-2"
                  and s["name"] == "POST /v1/chat/completions"]
        if fronts:
            break
        time.sleep(0.1)
    assert fronts and fronts[0]["parent"] == ""  # a root span: the malformed header changed nothing else
    # "Hi" is shorter than one KV block: routed without a kv-indexer query, so no "kv query" span
    names = sorted(s["name"] for s in receiver.trace(fronts[0]["trace"], 3))
    assert names == ["POST /v1/chat/completions", "engine POST /v1/chat/completions", "route"], names
    assert json.loads(raw)["usage"]["completion_tokens"] == 2


async def test_a_nats_client_request_joins_the_clients_trace_too(traced):
    fleet, receiver = traced
    if fleet.plane != "nats":
        pytest.skip("the NATS API is the NATS plane's")
    import nats

    from infera_common.subjects import API_CHAT_COMPLETIONS

    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    body = {"model": BUNDLED_MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    nc = await nats.connect(fleet.nats_url)
    try:
        msg = await nc.request(API_CHAT_COMPLETIONS, json.dumps(body).encode(), timeout=30,
                               headers={"traceparent": f"00-{trace_id}-{client_span}-01"})
    finally:
        await nc.close()
    assert json.loads(msg.data)["usage"]["completion_tokens"] == 2
    spans = {s["name"]: s for s in receiver.trace(trace_id, 3)}
    assert spans["NATS /v1/chat/completions"]["parent"] == client_span
    assert spans["route"]["parent"] == spans["NATS /v1/chat/completions"]["span"]
    assert spans["engine POST /v1/chat/completions"]["parent"] == spans["route"]["span"]


def engine_worker(fleet: Fleet) -> str:
    return fleet.workers_list()[0]["worker_id"]
