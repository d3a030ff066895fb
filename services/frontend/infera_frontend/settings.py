"""The frontend's settings: one field = one ``--flag`` + one ``INFERA_*`` env var + default + help."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import AliasChoices, Field, SecretStr, field_validator
from pydantic_settings import NoDecode, SettingsConfigDict

from infera_common.models import default_model_path
from infera_common.settings import DrainSettings, InferaSettings, LogSettings, PlaneSettings
from infera_common.subjects import TOKEN_RE


class ApiAddressSettings(InferaSettings):
    """Where the OpenAI HTTP API listens: the frontend's, and what ``infera up`` gives the one it starts."""

    host: str = Field("127.0.0.1", description="Address the OpenAI HTTP API listens on.")
    port: int = Field(8000, ge=0, le=65535, description="Port of the OpenAI HTTP API (0: a free port).")


class ApiKeySettings(InferaSettings):
    """The keys HTTP clients must present: the frontend's, and what ``infera up`` checks its fleet with."""

    api_key: Annotated[list[SecretStr], NoDecode] = Field(
        default_factory=list,
        description="Require 'Authorization: Bearer KEY' on every HTTP route but /health, /ready and /metrics "
        "(401 otherwise). Repeat the flag, or separate keys with commas in the environment variable, to accept "
        "several (to replace a key without refusing clients in between). Prefer the environment variable: a "
        "command line is visible to every user of the host. NATS clients are checked by the NATS server. "
        "Default: no key asked.",
    )

    @field_validator("api_key", mode="before")
    @classmethod
    def _key_list(cls, value: object) -> object:
        if isinstance(value, str):  # the environment variable: one key, or several separated by commas
            if not value.strip():
                return []  # set but empty (compose's ${INFERA_API_KEY:-}): no key asked
            value = [v for v in value.split(",") if v.strip()]
            if not value:
                raise ValueError("no key among the commas: give the keys, or leave the variable empty")
        if isinstance(value, list):
            value = [v.strip() if isinstance(v, str) else v for v in value]
            if "" in value:  # (an unset shell variable: --api-key "$KEY") would leave the API open
                raise ValueError("an empty key asks no key at all: give the key, or leave the flag out")
            if any(isinstance(v, str) and "," in v for v in value):
                raise ValueError("a key may not hold a comma (the environment variable separates keys with them)")
        return value

    def api_keys(self) -> list[str]:
        return [key.get_secret_value() for key in self.api_key]


class FrontendSettings(DrainSettings, PlaneSettings, LogSettings, ApiAddressSettings, ApiKeySettings):
    # the env prefix also applies to aliases: INFERA_MODEL_PATH / INFERA_ROUTER_TOKENIZER_PATH
    model_config = SettingsConfigDict(env_prefix_target="all")

    model_path: str = Field(
        default_factory=lambda: str(default_model_path()),
        validation_alias=AliasChoices("model_path", "router_tokenizer_path"),
        description="Model directory holding tokenizer.json and tokenizer_config.json (chat template), "
        "used to tokenize prompts for routing; must be the engines' tokenizer. "
        "Default: the bundled SmolLM2-135M-Instruct tokenizer.",
    )
    max_body_bytes: int = Field(
        8 * 1024 * 1024, ge=1024, description="Largest request body accepted, in bytes; larger bodies get 413."
    )
    max_sequences_per_request: int = Field(
        256, ge=1,
        description="Most sequences one request may ask the engines for: n samples of each of its prompts (a "
        "completions batch has several); more gets 400. 256 is the engines' default batch (SGLang's and the "
        "mock's max running requests, vLLM's --max-num-seqs on most GPUs): a wider request would fill a "
        "whole engine by itself. Raise it for best-of-n or rollout traffic.",
    )
    upstream_timeout: float = Field(
        60.0, gt=0,
        description="Seconds to wait for word from the worker: its response frames, and until the answer "
        "begins (a non-streaming answer, a stream's first token) the frames by which it says three times "
        "per timeout that the engine still holds the request; then the request is cancelled and the "
        "client gets 504. Mid-stream, the longest wait between two frames.",
    )
    request_timeout: float = Field(
        3600.0, gt=0,
        description="Longest a request may run end to end, streaming or not: sent as the request's "
        "deadline, after which the worker abandons it.",
    )
    route_timeout: float = Field(
        5.0, gt=0, description="Seconds to wait for the router's answer; then the client gets 503 'router "
        "unavailable'. A router that must wait on a prefill before it answers (vLLM's disaggregated pairs) "
        "says so, and --upstream-timeout applies from then.",
    )
    request_max_retries: int = Field(
        1, ge=0, le=10,
        description="How many more workers a request is tried on when it fails before its first byte reached "
        "the client (worker-agent 502/503/504, engine 429/502/503/504, no frame within --upstream-timeout, "
        "no router subscribed); never once a token was sent, never for other 4xx or cancellations. 0: no retry.",
    )
    tokenize_threads: int = Field(
        2, ge=1, le=64,
        description="Most long prompts (over 8,192 characters) tokenized at once, each in a worker thread off the "
        "event loop; the others wait their turn. Tokenizing holds memory in proportion to the prompt (~1.2 GB "
        "for an 8 MiB one), which this bounds; raise it on a frontend with more cores and memory.",
    )
    max_unread_frames: int = Field(
        32_768, ge=64,
        description="Most response frames of one request that may wait in the frontend for its client to read "
        "them (a stream sends about one per token and sample). A client reading more slowly than the engine "
        "writes (engines do not slow down for it) would pile them up without bound: past this, the request is "
        "cancelled on the engine and the client gets what waited, then an error.",
    )
    frontend_id: str | None = Field(
        None, pattern=TOKEN_RE.pattern,
        description="This frontend's id (letters, digits, '_', '-'); names its reply inbox. Default: generated.",
    )
    enable_nats_api: bool = Field(
        True, description="Also serve the OpenAI API to NATS request/reply clients (subjects infera.api.v1.*)."
    )
    access_log: bool = Field(False, description="Log one line per HTTP request (off by default: it costs latency).")

    @field_validator("model_path")
    @classmethod
    def _has_tokenizer(cls, value: str) -> str:
        if not (Path(value) / "tokenizer.json").is_file():
            raise ValueError(f"no tokenizer.json in {value} (pass a model directory holding the engines' tokenizer)")
        return value
