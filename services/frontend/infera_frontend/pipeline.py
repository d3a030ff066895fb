"""One completion request from raw body to a placed ``Exchange``: validate, check model, tokenize, route.

Shared by the HTTP API (``app.py``) and the NATS API (``nats_api.py``); each drives the returned
``Exchange`` into its own transport.
"""

from __future__ import annotations

import asyncio
import time
import uuid

from infera_common.schemas import Endpoint
from infera_common.tokenizer import ChatTokenizer

from infera_frontend.metrics import UNKNOWN_MODEL, FrontendMetrics
from infera_frontend.prepare import OFFLOAD_CHARS, ModelTable, Tokens, prompt_chars, tokenize
from infera_frontend.relay import Exchange, Relay
from infera_frontend.validation import ApiError, Parsed, check_request_id, parse_body


def new_request_id() -> str:
    return uuid.uuid4().hex


class Pipeline:
    def __init__(
        self, tokenizer: ChatTokenizer, models: ModelTable, relay: Relay, metrics: FrontendMetrics,
        max_body_bytes: int,
    ) -> None:
        self.tokenizer = tokenizer
        self.models = models
        self.relay = relay
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes

    @staticmethod
    def request_id(header: str | None) -> str:
        """The client's X-Request-Id (validated) or a new one; ``ApiError`` 400 if malformed."""
        return check_request_id(header, new_request_id)

    def too_large(self, size: int) -> ApiError:
        return ApiError(413, f"The request body is {size} bytes; the limit is {self.max_body_bytes} bytes.",
                        type="invalid_request_error", code="request_too_large")

    def parse(self, endpoint: Endpoint, body: bytes) -> Parsed:
        if len(body) > self.max_body_bytes:
            raise self.too_large(len(body))
        return parse_body(endpoint, body)

    def model_label(self, parsed: Parsed | None) -> str:
        """The metrics label of a request's model: only models the fleet knows (bounded cardinality)."""
        if parsed is not None and self.models.is_known(parsed.model):
            return parsed.model
        return UNKNOWN_MODEL

    async def tokens(self, parsed: Parsed) -> Tokens:
        t0 = time.perf_counter()
        if prompt_chars(parsed) > OFFLOAD_CHARS:
            tokens = await asyncio.to_thread(tokenize, self.tokenizer, parsed)
        else:
            tokens = tokenize(self.tokenizer, parsed)
        self.metrics.tokenized(parsed.endpoint.value, time.perf_counter() - t0)
        if not tokens.ok:
            self.metrics.token_invariant_failures.inc()
        return tokens

    async def open(self, parsed: Parsed, body: bytes, request_id: str) -> Exchange:
        """Check the model, tokenize and place the request; ``ApiError`` when it cannot be served."""
        self.models.check(parsed.model)
        tokens = await self.tokens(parsed)
        return await self.relay.open(
            request_id=request_id, endpoint=parsed.endpoint, model=parsed.model, body=body,
            stream=parsed.stream, token_ids=tokens.token_ids, prompt_tokens=tokens.prompt_tokens,
        )
