"""Typed request bodies of the OpenAI-style and SGLang-native endpoints (unknown fields are accepted,
as the engines do)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from infera_mock_engine.logprobs import MAX_LOGPROBS


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class PdFields(_Body):
    """Disaggregation and DP-routing fields both engines read from a generation body (pd_request.py)."""

    bootstrap_host: str | None = None
    bootstrap_port: int | None = Field(None, ge=0, le=65535)
    bootstrap_room: int | None = Field(None, ge=0, lt=2**63)
    routed_dp_rank: int | None = Field(None, ge=0)
    data_parallel_rank: int | None = Field(None, ge=0)  # SGLang's older name of routed_dp_rank
    disagg_prefill_dp_rank: int | None = Field(None, ge=0)
    kv_transfer_params: dict[str, Any] | None = None  # vLLM


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ChatMessage(_Body):
    role: str
    content: str | list[dict[str, Any]] | None = None


class _OpenAIRequest(PdFields):
    model: str | None = None
    cache_salt: str | None = None  # vLLM and SGLang: a prefix cache of its own (SGLang's list form is not simulated)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    top_k: int | None = None
    min_tokens: int = 0
    rid: str | None = None  # SGLang extension
    request_id: str | None = None  # vLLM extension

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage on every chunk, so far (``include_usage`` and ``continuous_usage_stats``)."""
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)


class ChatCompletionRequest(_OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @property
    def logprobs_k(self) -> int | None:
        """Alternatives per token when logprobs are asked for, else None."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_OpenAIRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    suffix: str | None = None
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @property
    def logprobs_k(self) -> int | None:
        return self.logprobs

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens


class SamplingParams(_Body):
    max_new_tokens: int | None = Field(None, ge=0)
    temperature: float = Field(1.0, ge=0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = Field(1, ge=1)
    sampling_seed: int | None = None
    seed: int | None = None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class GenerateRequest(PdFields):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    stream: bool = False
    rid: str | list[str] | None = None


class AbortRequest(_Body):
    rid: str = ""
    abort_all: bool = False
