"""Request validation, OpenAI error shapes and the model table: pure, no I/O."""

import json
import time

import pytest

from infera_common.fleet import Change, FleetView
from infera_common.openai_errors import error_body, normalize_error
from infera_common.schemas import Endpoint, WorkerRecord, WorkerStatus

from infera_frontend import prepare
from infera_frontend.listing import model_entry, models_list
from infera_frontend.prepare import (
    ContextLimit, ModelTable, Tokens, check_context, check_context_floor, longest_prompt_chars,
)
from infera_frontend.prepare import sequences
from infera_frontend.validation import UNKNOWN_SALT, ApiError, cache_salt, parse_body, request_ids

CHAT = Endpoint.CHAT
OK_MSG = [{"role": "user", "content": "hi"}]


def chat(**fields) -> bytes:
    return json.dumps({"model": "m", "messages": OK_MSG, **fields}).encode()


def rejected(endpoint: Endpoint, body: bytes) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse_body(endpoint, body)
    assert info.value.status == 400 and info.value.type == "invalid_request_error"
    return info.value


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{not json", None),
        (b"[1, 2]", None),
        (json.dumps({"messages": OK_MSG}).encode(), "model"),
        (json.dumps({"model": 7, "messages": OK_MSG}).encode(), "model"),
        (json.dumps({"model": "m"}).encode(), "messages"),
        (json.dumps({"model": "m", "messages": []}).encode(), "messages"),
        (json.dumps({"model": "m", "messages": "hi"}).encode(), "messages"),
        (json.dumps({"model": "m", "messages": [{"role": "robot", "content": "x"}]}).encode(), "messages[0].role"),
        (json.dumps({"model": "m", "messages": [{"role": "user", "content": 5}]}).encode(), "messages[0].content"),
        (json.dumps({"model": "m", "messages": [{"role": "user"}]}).encode(), "messages[0]"),
        (json.dumps({"model": "m", "messages": [{"role": "user", "content": [{"text": "x"}]}]}).encode(),
         "messages[0].content[0].type"),
        (chat(max_tokens=-1), "max_tokens"),
        (chat(max_tokens=0), "max_tokens"),
        (chat(max_tokens=1.5), "max_tokens"),
        (chat(max_completion_tokens=0), "max_completion_tokens"),
        (chat(n=0), "n"),
        (chat(n=1.5), "n"),
        (chat(stream="yes"), "stream"),
        (chat(stream=1), "stream"),
        (chat(temperature=-0.5), "temperature"),
        (chat(top_p=0), "top_p"),
        (chat(stop=[1]), "stop[0]"),
    ],
)
def test_invalid_chat_bodies_are_400_naming_the_field(body, param):
    err = rejected(CHAT, body)
    assert err.param == param
    assert err.message


def test_valid_chat_keeps_unknown_fields_and_reads_stream():
    parsed = parse_body(CHAT, chat(stream=True, n=1, max_tokens=5, temperature=0, top_k=3,
                                   chat_template_kwargs={"enable_thinking": False}))
    assert parsed.model == "m" and parsed.stream is True
    assert parsed.data["top_k"] == 3  # extra fields survive (and the raw bytes are forwarded anyway)


def test_assistant_tool_call_turn_may_have_null_content():
    msgs = [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": []}]
    assert parse_body(CHAT, json.dumps({"model": "m", "messages": msgs}).encode()).stream is False


@pytest.mark.parametrize("prompt", ["", "text", ["a", "b"], [1, 2, 3], [[1, 2], [3]]])
def test_completion_prompt_shapes_accepted(prompt):
    parse_body(Endpoint.COMPLETIONS, json.dumps({"model": "m", "prompt": prompt}).encode())


@pytest.mark.parametrize("prompt", [[], 5, [1, "a"], [-1], [[]], None, [2**32], [1.5], [[1], [2, "a"]], [[1], 2],
                                    ["a", 1], {"a": 1}])
def test_completion_prompt_shapes_rejected(prompt):
    assert rejected(Endpoint.COMPLETIONS, json.dumps({"model": "m", "prompt": prompt}).encode()).param == "prompt"


def test_a_client_request_id_is_echoed_as_given_and_carried_with_a_suffix_a_missing_one_generated():
    fresh = iter(["0123456789abcdef", "fedcba9876543210", "generated", "again"]).__next__
    assert request_ids("abc.DEF_1:2-3", fresh) == ("abc.DEF_1:2-3", "abc.DEF_1:2-3-01234567")
    assert request_ids("abc.DEF_1:2-3", fresh) == ("abc.DEF_1:2-3", "abc.DEF_1:2-3-fedcba98")  # one id, two requests
    assert request_ids(None, fresh) == ("generated", "generated")
    assert request_ids("", fresh) == ("again", "again")


@pytest.mark.parametrize("given, carried", [
    ("has space", "has_space"), ("aGVsbG8+d29y/bGQ=", "aGVsbG8_d29y_bGQ_"), ("{uuid}", "_uuid_"),
    ("ünï", "_n_"), ("x" * 300, "x" * 128),
])
def test_a_request_id_of_other_characters_is_echoed_as_given_and_carried_in_safe_ones(given, carried):
    assert request_ids(given, lambda: "0123456789abcdef") == (given, f"{carried}-01234567")


def test_error_body_shape():
    assert error_body(404, "nope", code="model_not_found", param="model") == {
        "error": {"message": "nope", "type": "not_found_error", "param": "model", "code": "model_not_found"}
    }
    assert error_body(400, "bad")["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("raw", "message", "etype"),
    [
        (b'{"error": {"message": "m1", "type": "t", "param": null, "code": 1}}', "m1", "invalid_request_error"),
        (b'{"error": {"message": "m2"}}', "m2", "invalid_request_error"),
        (b'{"object": "error", "message": "m3", "type": "BadRequestError", "param": null, "code": 400}', "m3",
         "invalid_request_error"),  # SGLang's shape, vLLM's type name: OpenAI's type
        (b'{"error": {"message": "m6", "type": "BadRequest", "param": "n", "code": 400}}', "m6",
         "invalid_request_error"),
        (b'{"detail": "m4"}', "m4", "invalid_request_error"),
        (b'{"detail": [{"loc": ["body"], "msg": "m5"}]}', "m5", "invalid_request_error"),
        (b"plain text failure", "plain text failure", "invalid_request_error"),
        (b"", "upstream error (HTTP 400)", "invalid_request_error"),
    ],
)
def test_engine_errors_become_openai_errors(raw, message, etype):
    err = json.loads(normalize_error(400, raw))["error"]
    assert err["message"] == message and err["type"] == etype
    assert set(err) == {"message", "type", "param", "code"}


def test_an_openai_shaped_engine_error_is_passed_verbatim():
    raw = b'{"error": {"message": "m", "type": "invalid_request_error", "param": null, "code": "too_long"}}'
    assert normalize_error(400, raw) is raw


def test_an_engine_codes_and_types_become_openais():
    """The engines repeat the status as an integer code and name the type after a class."""
    err = json.loads(normalize_error(400, b'{"error": {"message": "m", "type": "BadRequestError", '
                                          b'"param": "max_tokens", "code": 400}}'))["error"]
    assert err == {"message": "m", "type": "invalid_request_error", "param": "max_tokens", "code": None}
    err = json.loads(normalize_error(500, b'{"error": {"message": "m", "type": "INTERNAL_SERVER_ERROR", '
                                          b'"code": 9}}'))["error"]
    assert (err["type"], err["code"]) == ("internal_server_error", "9")
    # vLLM's FastAPI validation errors name where in the request the field is: OpenAI names the field
    err = json.loads(normalize_error(400, b'{"error": {"message": "1 validation errors", "type": "Bad Request", '
                                          b'"param": "body.stop", "code": 400}}'))["error"]
    assert err["param"] == "stop" and err["type"] == "invalid_request_error"


def _rec(wid: str, model: str, status: WorkerStatus, context_length: int | None = None,
         clamps: bool = False) -> WorkerRecord:
    return WorkerRecord(worker_id=wid, model=model, engine="mock", url="http://x", advertise_host="x",
                        status=status, heartbeat_at=time.time(), context_length=context_length,
                        clamps_max_tokens=clamps)


def _status(table: ModelTable, model: str) -> int:
    try:
        table.check(model)
    except ApiError as err:
        return err.status
    return 200


def test_model_table_follows_discovery():
    table = ModelTable()
    assert _status(table, "m") == 404
    table.apply(Change("join", _rec("a", "m", WorkerStatus.STARTING)))
    assert _status(table, "m") == 503 and table.is_known("m")
    table.apply(Change("update", _rec("a", "m", WorkerStatus.ACTIVE)))
    assert _status(table, "m") == 200
    table.apply(Change("join", _rec("b", "m", WorkerStatus.ACTIVE)))
    table.apply(Change("update", _rec("a", "m", WorkerStatus.DRAINING)))
    assert _status(table, "m") == 200
    table.apply(Change("leave", _rec("b", "m", WorkerStatus.ACTIVE)))
    assert _status(table, "m") == 503
    table.apply(Change("leave", _rec("a", "m", WorkerStatus.DRAINING)))
    # every worker gone: the model is unavailable, not unknown (an outage is not the client's error)
    assert _status(table, "m") == 503 and table.is_known("m")
    assert _status(table, "typo") == 404 and not table.is_known("typo")


def test_a_workers_aliases_are_served_and_listed_as_its_model_is():
    table, view = ModelTable(), FleetView()
    for rec in (_rec("a", "m", WorkerStatus.ACTIVE).model_copy(update={"aliases": ["m-latest"]}),
                _rec("b", "other", WorkerStatus.ACTIVE)):
        table.apply(Change("join", rec))
        view.put(rec, time.monotonic(), time.time())
    assert _status(table, "m-latest") == _status(table, "m") == 200
    assert [m["id"] for m in models_list(view)["data"]] == ["m", "m-latest", "other"]
    assert model_entry(view, "m-latest")["id"] == "m-latest" and view.active("m-latest")[0].worker_id == "a"
    # the engine restarted without the alias: requests for it are refused as for any model gone
    rec = _rec("a", "m", WorkerStatus.ACTIVE)
    table.apply(Change("update", rec))
    view.put(rec, time.monotonic(), time.time())
    assert _status(table, "m-latest") == 503 and _status(table, "m") == 200
    assert "m-latest" not in [m["id"] for m in models_list(view)["data"]]


def test_a_workers_adapters_are_served_and_listed_with_their_base_model():
    table, view = ModelTable(), FleetView()
    for rec in (_rec("a", "m", WorkerStatus.ACTIVE).model_copy(update={"adapters": ["sql"]}),
                _rec("b", "m", WorkerStatus.ACTIVE)):
        table.apply(Change("join", rec))
        view.put(rec, time.monotonic(), time.time())
    assert _status(table, "sql") == _status(table, "m") == 200
    listed = {m["id"]: m for m in models_list(view)["data"]}
    assert listed["sql"]["parent"] == "m" and "parent" not in listed["m"]
    assert model_entry(view, "sql")["parent"] == "m"
    assert [w.worker_id for w in view.active("sql")] == ["a"]  # only the worker that serves it
    # SGLang's own form, <model>:<adapter> (split at the first colon), names the adapter too
    assert table.resolve("m:sql") == "sql" and table.resolve("sql") == "sql" and table.resolve("m") == "m"
    assert table.resolve("m:nope") == "m:nope" and table.resolve("x:sql") == "x:sql"
    assert table.resolve("m:sql:x") == "m:sql:x"
    with pytest.raises(ApiError) as err:  # with a model that does not serve it: the model that does
        table.check("x:sql")
    assert err.value.status == 404 and "The LoRA adapter `sql` is served with `m`: give `sql`" in err.value.message
    with pytest.raises(ApiError) as err:
        table.check("m:nope")
    assert "LoRA" not in err.value.message
    # a name some worker serves whole wins over the form; the form ends with its last worker
    table.apply(Change("join", _rec("c", "m:sql", WorkerStatus.ACTIVE)))
    assert table.resolve("m:sql") == "m:sql"
    table.apply(Change("leave", _rec("c", "m:sql", WorkerStatus.ACTIVE)))
    assert table.resolve("m:sql") == "sql"
    table.apply(Change("leave", _rec("a", "m", WorkerStatus.ACTIVE)))
    assert table.resolve("x:y") == "x:y" and _status(table, "sql") == 503


def test_the_models_that_lost_their_workers_are_remembered_within_a_bound(monkeypatch):
    monkeypatch.setattr(prepare, "SERVED_MODELS_KEPT", 3)
    table = ModelTable()
    for model in ("m1", "m2", "m3", "m1", "m4"):  # m1 served again: the most recent
        table.apply(Change("join", _rec(model, model, WorkerStatus.ACTIVE)))
        table.apply(Change("leave", _rec(model, model, WorkerStatus.ACTIVE)))
    assert [_status(table, m) for m in ("m1", "m2", "m3", "m4")] == [503, 404, 503, 503]


@pytest.mark.parametrize("endpoint, body, expected", [
    (CHAT, {"model": "m", "messages": [{"role": "user", "content": "x"}]}, 1),
    (CHAT, {"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 3}, 3),
    (Endpoint.COMPLETIONS, {"model": "m", "prompt": "x", "n": 2}, 2),
    (Endpoint.COMPLETIONS, {"model": "m", "prompt": [1, 2, 3], "n": 2}, 2),  # token ids: one prompt
    (Endpoint.COMPLETIONS, {"model": "m", "prompt": ["a", "b", "c"]}, 3),
    (Endpoint.COMPLETIONS, {"model": "m", "prompt": [[1], [2]], "n": 4}, 8),
])
def test_the_sequences_a_request_runs_in_the_engine(endpoint, body, expected):
    assert sequences(parse_body(endpoint, json.dumps(body).encode())) == expected


def test_the_context_length_of_a_model_is_the_longest_its_active_workers_take():
    table = ModelTable()
    assert table.context_limit("m") is None
    table.apply(Change("join", _rec("a", "m", WorkerStatus.ACTIVE, 4096)))
    table.apply(Change("join", _rec("b", "m", WorkerStatus.ACTIVE, 8192)))
    table.apply(Change("join", _rec("c", "m", WorkerStatus.STARTING, 100)))  # not routable: not counted
    table.apply(Change("join", _rec("d", "other", WorkerStatus.ACTIVE, 1000, clamps=True)))
    assert table.context_limit("m") == ContextLimit(8192)  # a request some worker takes is not refused
    table.apply(Change("update", _rec("b", "m", WorkerStatus.DRAINING, 8192)))
    assert table.context_limit("m") == ContextLimit(4096)
    table.apply(Change("join", _rec("f", "m", WorkerStatus.ACTIVE, 2048, clamps=True)))
    assert table.context_limit("m") == ContextLimit(4096, clamps=True)  # one clamps: what it would serve passes
    table.apply(Change("leave", _rec("f", "m", WorkerStatus.ACTIVE, 2048, clamps=True)))
    table.apply(Change("join", _rec("e", "m", WorkerStatus.ACTIVE)))  # an agent that does not say
    assert table.context_limit("m") is None  # it may take anything: nothing refused
    table.apply(Change("leave", _rec("e", "m", WorkerStatus.ACTIVE)))
    table.apply(Change("leave", _rec("a", "m", WorkerStatus.ACTIVE, 4096)))
    assert table.context_limit("m") is None and table.context_limit("other") == ContextLimit(1000, clamps=True)


def _context_error(endpoint: Endpoint, body: dict, tokens: Tokens, limit: int | None,
                   clamps: bool = False) -> ApiError | None:
    context = ContextLimit(limit, clamps) if limit is not None else None
    try:
        check_context(parse_body(endpoint, json.dumps({"model": "m", **body}).encode()), tokens, context)
    except ApiError as err:
        assert err.status == 400 and err.code == "context_length_exceeded"
        return err
    return None


@pytest.mark.parametrize("endpoint, body, tokens, limit, param", [
    (CHAT, {"messages": OK_MSG}, Tokens(None, 100), 100, "messages"),  # no room for one output token
    (CHAT, {"messages": OK_MSG}, Tokens(None, 99), 100, None),
    (CHAT, {"messages": OK_MSG, "max_tokens": 2}, Tokens(None, 99), 100, "max_tokens"),
    (CHAT, {"messages": OK_MSG, "max_tokens": 1}, Tokens(None, 99), 100, None),
    (CHAT, {"messages": OK_MSG, "max_completion_tokens": 2, "max_tokens": 1}, Tokens(None, 99), 100,
     "max_completion_tokens"),
    (Endpoint.COMPLETIONS, {"prompt": "x", "max_tokens": 50}, Tokens(None, 60), 100, "max_tokens"),
    (Endpoint.COMPLETIONS, {"prompt": ["x", "y"]}, Tokens(None, 150, longest=90), 100, None),  # each fits
    (Endpoint.COMPLETIONS, {"prompt": ["x", "y"]}, Tokens(None, 150, longest=100), 100, "prompt"),
    (Endpoint.COMPLETIONS, {"prompt": "x"}, Tokens(None, 10**6), None, None),  # the fleet did not say
    (Endpoint.COMPLETIONS, {"prompt": "x", "truncate_prompt_tokens": 50}, Tokens(None, 500), 100, None),
    (CHAT, {"messages": OK_MSG}, Tokens(None, 0, ok=False), 100, None),  # count unknown: the engine decides
])
def test_a_request_past_the_context_length_is_refused_before_routing(endpoint, body, tokens, limit, param):
    err = _context_error(endpoint, body, tokens, limit)
    assert (err.param if err else None) == param
    if err is not None:
        assert f"maximum context length is {limit} tokens" in err.message


@pytest.mark.parametrize("endpoint, body, tokens, param", [
    (CHAT, {"messages": OK_MSG, "max_tokens": 50}, Tokens(None, 99), None),  # cut to 1 output token
    (CHAT, {"messages": OK_MSG, "max_tokens": 100}, Tokens(None, 10), None),
    (CHAT, {"messages": OK_MSG, "max_tokens": 101}, Tokens(None, 10), "max_tokens"),  # past the length itself
    (CHAT, {"messages": OK_MSG, "max_completion_tokens": 101}, Tokens(None, 10), "max_completion_tokens"),
    (CHAT, {"messages": OK_MSG, "max_tokens": 1}, Tokens(None, 100), "messages"),  # still no room at all
    (Endpoint.COMPLETIONS, {"prompt": "x", "max_tokens": 90}, Tokens(None, 60), None),
])
def test_workers_that_clamp_max_tokens_are_refused_only_what_they_refuse(endpoint, body, tokens, param):
    # vLLM cuts max_tokens to what the prompt leaves of the context; it refuses max_tokens past the
    # context length itself, and prompts that leave no room
    err = _context_error(endpoint, body, tokens, 100, clamps=True)
    assert (err.param if err else None) == param


def test_the_floor_refuses_only_what_cannot_fit_and_says_it_is_a_floor():
    chat = parse_body(CHAT, json.dumps({"model": "m", "messages": OK_MSG, "max_tokens": 10}).encode())
    check_context_floor(chat, 90, ContextLimit(100))  # 90 tokens at least, 100 at most: it may fit
    check_context_floor(chat, 95, ContextLimit(100, clamps=True))  # its max_tokens would be cut
    with pytest.raises(ApiError) as caught:
        check_context_floor(chat, 91, ContextLimit(100))  # 91 + 10 cannot
    assert caught.value.param == "max_tokens" and "at least 101 tokens (at least 91 in the messages" in caught.value.message
    check_context_floor(chat, 10**6, None)  # no limit known: nothing refused


@pytest.mark.parametrize("endpoint, body, chars", [
    (CHAT, {"messages": [{"role": "user", "content": "abc"}, {"role": "user", "content": "de"}]}, 5),
    (Endpoint.COMPLETIONS, {"prompt": "abcd"}, 4),
    (Endpoint.COMPLETIONS, {"prompt": ["ab", "abcdef", "a"]}, 6),  # each prompt is one sequence
    (Endpoint.COMPLETIONS, {"prompt": [1, 2, 3]}, 0),  # token ids: counted exactly, not bounded
])
def test_the_longest_prompt_to_tokenize(endpoint, body, chars):
    assert longest_prompt_chars(parse_body(endpoint, json.dumps({"model": "m", **body}).encode())) == chars


def test_the_model_list_gives_the_context_length_when_every_active_worker_said_it():
    view = FleetView()
    now = time.time()
    view.put(_rec("a", "m", WorkerStatus.ACTIVE, 4096), 0.0, now)
    view.put(_rec("b", "m", WorkerStatus.ACTIVE, 8192), 0.0, now)
    view.put(_rec("c", "m", WorkerStatus.DRAINING, 100_000), 0.0, now)  # not routable: not counted
    view.put(_rec("d", "other", WorkerStatus.ACTIVE), 0.0, now)  # did not say
    listed = {m["id"]: m for m in models_list(view)["data"]}
    assert listed["m"]["max_model_len"] == 8192 and "max_model_len" not in listed["other"]
    assert model_entry(view, "m") == listed["m"] and model_entry(view, "gone") is None


@pytest.mark.parametrize("salt, expected", [
    (None, None), ("tenant-a", "tenant-a"), (["a", "b"], UNKNOWN_SALT), (7, UNKNOWN_SALT),
])
def test_the_cache_salt_the_router_hashes_a_prompt_under(salt, expected):
    body = {"model": "m", "prompt": "x", **({} if salt is None else {"cache_salt": salt})}
    assert cache_salt(parse_body(Endpoint.COMPLETIONS, json.dumps(body).encode())) == expected
