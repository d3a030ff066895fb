"""LoRA adapters in the mock engine: listed, served by name, with KV blocks of their own that the
KV events name, as vLLM 0.32 does (its block hash takes the adapter; BlockStored carries lora_id
and lora_name)."""

from __future__ import annotations

import msgpack
import pytest

from infera_common.kv_translate import BlockTranslator
from infera_common.kv_wire import BlockStored, decode_batch
from infera_common.block_hash import ROOT, adapter_root, block_hashes, salted_root
from infera_mock_engine.lora import LoraRegistry
from infera_mock_engine.main import parse_args

from .test_kv_events import PAGE, PROMPT_A, Subscriber, kv_config, local

LORA = ("--enable-lora", "--lora-modules", "sql=/adapters/sql",
        '{"name": "chat", "path": "/adapters/chat", "base_model_name": "smol"}')


async def cached(client, model: str, prompt: list[int]) -> int:
    status, body = await client.post("/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 2})
    assert status == 200, body
    assert body["model"] == model
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


async def test_adapters_are_listed_with_their_base_and_keep_kv_blocks_of_their_own(kv_engine):
    client = await kv_engine("vllm", "--kv-events-config", kv_config(), *LORA)
    _, models = await client.get_json("/v1/models")
    listed = {m["id"]: m for m in models["data"]}
    assert listed["smol"]["parent"] is None
    assert (listed["sql"]["parent"], listed["sql"]["root"]) == ("smol", "/adapters/sql")
    assert listed["chat"]["parent"] == "smol" and list(listed) == ["smol", "sql", "chat"]
    status, body = await client.post("/v1/completions", {"model": "nope", "prompt": PROMPT_A, "max_tokens": 2})
    assert status == 404 and "nope" in body["error"]["message"]

    sub = Subscriber(local((await client.get_json("/kv_event_sources"))[1]["0"]["endpoint"]))
    try:
        await sub.sync(client)
        assert await cached(client, "sql", PROMPT_A) == 0
        assert await cached(client, "sql", PROMPT_A) == 48  # the adapter's own blocks, reused
        assert await cached(client, "smol", PROMPT_A) == 0  # the base model computes its own
        assert await cached(client, "chat", PROMPT_A) == 0  # and so does another adapter
        assert await cached(client, "smol", PROMPT_A) == 48
        messages = await sub.collect()
    finally:
        sub.close()

    raw = [e for _, _, payload in messages for e in msgpack.unpackb(payload)[1] if e["type"] == "BlockStored"]
    assert [(e["lora_id"], e["lora_name"]) for e in raw] == [(1, "sql"), (None, None), (2, "chat")]
    assert raw[0]["extra_keys"] == [["sql"]] * 3 and raw[1]["extra_keys"] == [None] * 3
    # Infera's index keeps them apart: each chain starts from its adapter's root
    translator = BlockTranslator()
    held = set()
    for _, _, payload in messages:
        held |= translator.apply(decode_batch(payload).events).stored.get(PAGE, set())
    for adapter in ("sql", None, "chat"):
        assert set(block_hashes(PROMPT_A[:48], PAGE, adapter_root(adapter))) <= held
    assert len(held) == 9
    stored = [e for _, _, p in messages for e in decode_batch(p).events if isinstance(e, BlockStored)]
    assert [e.lora_name for e in stored] == ["sql", None, "chat"]


@pytest.mark.parametrize("flags, message", [
    (("--lora-modules", "sql=/a"), "--lora-modules needs --enable-lora"),
    (("--enable-lora", "--lora-modules", "sql=/a", "sql=/b"), "The lora adapter 'sql' has already been loaded"),
    (("--enable-lora", "--served-model-name", "smol", "--lora-modules", "smol=/a"), "conflicts with a served base"),
    (("--enable-lora", "--lora-modules", '{"name": "x"}'), "Invalid fields for --lora-modules"),
    (("--enable-lora", "--lora-modules", "a,b"), "Invalid JSON format for --lora-modules"),
])
def test_lora_flags_the_engine_refuses_fail_at_start_naming_the_flag(model_dir, capsys, flags, message):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--model-path", str(model_dir), "--engine-flavor", "vllm", *flags])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_adapters_are_numbered_from_one_in_the_order_given(model_dir):
    config, _ = parse_args(["--model-path", str(model_dir), *LORA])
    registry = LoraRegistry(config.lora_modules, config.served_model_names, config.enable_lora)
    assert [(registry.get(name).id, m.name) for name, m in zip(("sql", "chat"), registry.modules())] == [
        (1, "sql"), (2, "chat")]


async def text_post(client, path: str, body: dict) -> tuple[int, str]:
    async with client.session.post(path, json=body) as r:
        return r.status, await r.text()


async def test_adapters_load_and_unload_at_run_time_only_when_vllm_allows_it(start_engine, monkeypatch):
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")
    client = await start_engine("--engine-flavor", "vllm", "--served-model-name", "smol", *LORA)
    assert await text_post(client, "/v1/load_lora_adapter", {"lora_name": "new", "lora_path": "/a/new"}) == (
        200, "Success: LoRA adapter 'new' added successfully.")
    _, models = await client.get_json("/v1/models")
    assert [(m["id"], m["parent"]) for m in models["data"]] == [
        ("smol", None), ("sql", "smol"), ("chat", "smol"), ("new", "smol")]
    assert await cached(client, "new", PROMPT_A) == 0
    status, text = await text_post(client, "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "/b"})
    assert status == 400 and "already been loaded" in text
    status, text = await text_post(client, "/v1/load_lora_adapter", {"lora_name": "smol", "lora_path": "/b"})
    assert status == 400 and "conflicts with a served base model" in text
    assert (await text_post(client, "/v1/unload_lora_adapter", {"lora_name": "sql"}))[0] == 200
    status, text = await text_post(client, "/v1/unload_lora_adapter", {"lora_name": "sql"})
    assert status == 404 and "cannot be found" in text
    status, body = await client.post("/v1/completions", {"model": "sql", "prompt": PROMPT_A, "max_tokens": 2})
    assert status == 404  # no longer served
    # a number is never reused: the next adapter loaded is the fourth
    await text_post(client, "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "/a/sql2"})
    assert client.server.engine.lora.get("sql").id == 4

    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
    fixed = await start_engine("--engine-flavor", "vllm", *LORA)
    assert (await text_post(fixed, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/x"}))[0] == 404


async def test_the_sglang_flavour_names_an_adapter_after_its_served_name_as_sglang_does(kv_engine):
    client = await kv_engine("sglang", "--kv-events-config", kv_config(), "--lora-paths", "sql=/adapters/sql",
                             '{"lora_name": "chat", "lora_path": "/adapters/chat", "pinned": true}')
    _, models = await client.get_json("/v1/models")
    assert [(m["id"], m["parent"], m["owned_by"]) for m in models["data"]] == [
        ("smol", None, "sglang"), ("sql", "smol", "sglang"), ("chat", "smol", "sglang")]
    sub = Subscriber(local((await client.get_json("/kv_event_sources"))[1]["0"]["endpoint"]))
    try:
        await sub.sync(client)
        assert await cached(client, "smol:sql", PROMPT_A) == 0
        assert await cached(client, "smol:sql", PROMPT_A) == 48
        assert await cached(client, "sql", PROMPT_A) == 0  # a bare adapter name: SGLang runs the base model
        assert await cached(client, "smol", PROMPT_A) == 48
        messages = await sub.collect()
    finally:
        sub.close()
    status, body = await client.post("/v1/completions", {"model": "smol:nope", "prompt": PROMPT_A, "max_tokens": 2})
    assert status == 400 and "'nope' has never been loaded" in body["message"]  # SGLang's error shape
    raw = [e for _, _, payload in messages for e in msgpack.unpackb(payload)[1]]
    mapped = [e for e in raw if isinstance(e, dict)]
    assert len(mapped) == 3 and {(e["lora_id"], e["lora_name"]) for e in mapped} == {(None, "sql")}
    assert all(e[0] != "BlockStored" or len(e) == 7 for e in raw if isinstance(e, list))  # the base model's
    stored = [e for _, _, p in messages for e in decode_batch(p).events if isinstance(e, BlockStored)]
    assert [e.lora_name for e in stored] == ["sql"] * 3 + [None] * 3

    # run-time adapters: always served by SGLang's own endpoints
    async with client.session.post("/load_lora_adapter", json={"lora_name": "late", "lora_path": "/l"}) as r:
        answer = await r.json()
        assert r.status == 200 and answer["success"] and answer["loaded_adapters"]["late"] == "/l"
    async with client.session.post("/unload_lora_adapter", json={"lora_name": "nope"}) as r:
        assert r.status == 400 and not (await r.json())["success"]
    async with client.session.post("/unload_lora_adapter", json={"lora_name": "sql"}) as r:
        assert r.status == 200 and "sql" not in (await r.json())["loaded_adapters"]
    _, models = await client.get_json("/v1/models")
    assert "sql" not in [m["id"] for m in models["data"]]
    # SGLang loads it again, under a fresh id: the blocks it computed before are not reused
    assert await cached(client, "smol:sql", PROMPT_A) == 0
    _, models = await client.get_json("/v1/models")
    assert "sql" in [m["id"] for m in models["data"]]


@pytest.mark.parametrize("flavor", ["vllm", "sglang"])
async def test_a_salted_prompt_keeps_a_cache_of_its_own_and_its_events_say_the_salt(kv_engine, flavor):
    client = await kv_engine(flavor, "--kv-events-config", kv_config())

    async def run(salt: str | None) -> int:
        body = {"model": "smol", "prompt": PROMPT_A, "max_tokens": 2, **({"cache_salt": salt} if salt else {})}
        status, answer = await client.post("/v1/completions", body)
        assert status == 200, answer
        return answer["usage"]["prompt_tokens_details"]["cached_tokens"]

    sub = Subscriber(local((await client.get_json("/kv_event_sources"))[1]["0"]["endpoint"]))
    try:
        await sub.sync(client)
        assert [await run("t1"), await run("t1"), await run(None), await run("t2")] == [0, 48, 0, 0]
        messages = await sub.collect()
    finally:
        sub.close()
    raw = [e for _, _, payload in messages for e in msgpack.unpackb(payload)[1]]
    if flavor == "vllm":
        assert [e["extra_keys"] for e in raw if e["type"] == "BlockStored"] == [
            [["t1"], None, None], [None] * 3, [["t2"], None, None]]
    else:  # SGLang 0.5.23: the salt on every event of the chain, in its tagged map
        assert [e.get("cache_salt") for e in raw if isinstance(e, dict)] == ["t1"] * 3 + ["t2"] * 3
    translator = BlockTranslator()
    held = set()
    for _, _, payload in messages:
        held |= translator.apply(decode_batch(payload).events).stored.get(PAGE, set())
    for salt in ("t1", None, "t2"):
        assert set(block_hashes(PROMPT_A[:48], PAGE, salted_root(ROOT, salt))) <= held


def _adapter_dir(root, name: str, base: str, peft_type: str = "LORA") -> None:
    import json

    (root / name).mkdir()
    (root / name / "adapter_config.json").write_text(
        json.dumps({"peft_type": peft_type, "base_model_name_or_path": base, "r": 8}))


async def test_vllms_filesystem_resolver_loads_an_adapter_when_a_request_first_names_it(
        kv_engine, monkeypatch, tmp_path):
    """vLLM 0.32's lora_filesystem_resolver: with run-time updates on and VLLM_LORA_RESOLVER_CACHE_DIR
    set, an unknown model name that is a LoRA directory there for this engine's model is loaded."""
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")
    monkeypatch.setenv("VLLM_LORA_RESOLVER_CACHE_DIR", str(tmp_path))
    client = await kv_engine("vllm", "--enable-lora")
    base = client.server.engine.config.model_path
    _adapter_dir(tmp_path, "found", base)
    _adapter_dir(tmp_path, "other-base", "/another/model")
    _adapter_dir(tmp_path, "not-lora", base, peft_type="IA3")
    _, models = await client.get_json("/v1/models")
    assert [m["id"] for m in models["data"]] == ["smol"]  # not listed until a request names it
    assert await cached(client, "found", PROMPT_A) == 0
    assert await cached(client, "found", PROMPT_A) == 48  # loaded once, its blocks its own
    _, models = await client.get_json("/v1/models")
    assert [(m["id"], m["parent"]) for m in models["data"]] == [("smol", None), ("found", "smol")]
    for name in ("other-base", "not-lora", "absent"):
        status, _ = await client.post("/v1/completions", {"model": name, "prompt": PROMPT_A, "max_tokens": 2})
        assert status == 404, name
    monkeypatch.setenv("VLLM_PLUGINS", "some_other_plugin")  # the resolver's plugin not loaded
    _adapter_dir(tmp_path, "later", base)
    status, _ = await client.post("/v1/completions", {"model": "later", "prompt": PROMPT_A, "max_tokens": 2})
    assert status == 404
