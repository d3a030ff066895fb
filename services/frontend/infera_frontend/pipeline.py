"""One completion request from raw body to a started ``Exchange``: validate, check model, tokenize,
route, and try another worker when an attempt fails before its first byte (``failover.py``).

Shared by the HTTP API (``app.py``) and the NATS API (``nats_api.py``); each drives the returned
``Exchange`` into its own transport.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable

import orjson

from infera_common.logs import get_logger
from infera_common.nats_conn import RepeatedErrors
from infera_common.schemas import Endpoint
from infera_common.tokenizer import ChatTokenizer

from infera_frontend.exchange import Exchange
from infera_frontend.failover import ROUTE_TIMEOUT, Attempts, engine_status_reason, retry_reason
from infera_frontend.metrics import UNKNOWN_MODEL, FrontendMetrics
from infera_frontend.prepare import (
    OFFLOAD_CHARS, ModelTable, Tokens, check_context, check_context_floor, check_sequences, longest_prompt_chars,
    prompt_chars, samples, sequences, tokenize,
)
from infera_frontend.relay import Relay
from infera_frontend.validation import ApiError, Parsed, cache_salt, parse_body, request_ids

log = get_logger("frontend.pipeline")
#: Seconds between two ``request_failed_upstream`` lines of one status (an outage fails every request).
FAILURES_LOG_EVERY = 10.0


def new_request_id() -> str:
    return uuid.uuid4().hex


class Pipeline:
    def __init__(
        self, tokenizer: ChatTokenizer, models: ModelTable, relay: Relay, metrics: FrontendMetrics,
        max_body_bytes: int, max_retries: int, max_sequences: int | None, tokenize_threads: int,
    ) -> None:
        self.tokenizer = tokenizer
        self.models = models
        self.relay = relay
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self.max_retries = max_retries
        self.max_sequences = max_sequences
        self._threads = asyncio.Semaphore(tokenize_threads)  # long prompts tokenized at once (memory)
        self._failures = RepeatedErrors(FAILURES_LOG_EVERY)  # request_failed_upstream lines, per status

    @staticmethod
    def request_ids(header: str | None) -> tuple[str, str]:
        """(the id echoed to the client, the id carried to the worker and engine): ``validation.request_ids``."""
        return request_ids(header, new_request_id)

    def too_large(self, size: int) -> ApiError:
        return ApiError(413, f"The request body is {size} bytes; the limit is {self.max_body_bytes} bytes.",
                        type="invalid_request_error", code="request_too_large")

    def parse(self, endpoint: Endpoint, body: bytes) -> Parsed:
        if len(body) > self.max_body_bytes:
            raise self.too_large(len(body))
        parsed = parse_body(endpoint, body)
        if self.max_sequences is not None:
            check_sequences(parsed, self.max_sequences)
        return parsed

    def model_label(self, parsed: Parsed | None) -> str:
        """The metrics label of a request's model: only models the fleet knows (bounded cardinality)."""
        if parsed is not None and self.models.is_known(parsed.model):
            return parsed.model
        return UNKNOWN_MODEL

    async def tokens(self, parsed: Parsed) -> Tokens:
        t0 = time.perf_counter()
        if prompt_chars(parsed) > OFFLOAD_CHARS:
            async with self._threads:
                tokens = await asyncio.to_thread(tokenize, self.tokenizer, parsed)
        else:
            tokens = tokenize(self.tokenizer, parsed)
        self.metrics.tokenized(parsed.endpoint.value, time.perf_counter() - t0)
        if not tokens.ok:
            self.metrics.token_invariant_failures.inc()
        return tokens

    async def open(
        self, parsed: Parsed, body: bytes, request_id: str, *, session_ids: list[str] | None = None,
        cancel_reason: str | Callable[[], str] = "client_disconnect", traceparent: str | None = None,
    ) -> Exchange:
        """Check the model, tokenize, place the request and start it; ``ApiError`` when it cannot be served.

        The returned exchange has its ``status`` and ``body`` (``None`` for a stream, whose first
        payloads are buffered); nothing has reached the client yet. An attempt that fails retryably
        is tried again on a worker not tried yet, up to ``max_retries`` times. When the router cannot
        place a retry (no other worker, all full, router gone), the failed attempt's answer stands.
        If the caller is cancelled meanwhile, the running attempt gets a ``Cancel`` (``cancel_reason``, or
        what it returns then).
        """
        name = self.models.resolve(parsed.model)
        if name != parsed.model:  # SGLang's <model>:<adapter>: sent on as the adapter (the router names it per engine)
            parsed.model = parsed.data["model"] = name
            body = orjson.dumps(parsed.data)
        self.models.check(parsed.model)
        limit = self.models.context_limit(parsed.model)
        check_context_floor(parsed, self.tokenizer.min_tokens(longest_prompt_chars(parsed)), limit)
        tokens = await self.tokens(parsed)
        check_context(parsed, tokens, limit)
        attempts = Attempts(self.max_retries)
        failed: ApiError | Exchange | None = None  # the previous attempt's answer, while retrying
        carried = request_id  # the id the attempt carries to its worker and engine
        silence = False  # the previous attempt got no route reply
        while True:
            try:
                ex = await self.relay.open(
                    request_id=carried, endpoint=parsed.endpoint, model=parsed.model, body=body,
                    stream=parsed.stream, token_ids=tokens.token_ids, prompt_tokens=tokens.prompt_tokens,
                    exclude=attempts.tried, session_ids=session_ids, traceparent=traceparent,
                    sequences=sequences(parsed), samples=samples(parsed), after_silence=silence,
                    cache_salt=cache_salt(parsed),
                )
            except ApiError as err:
                if failed is not None:
                    log.info("retry_not_placed", request_id=request_id, status=err.status, error=err.message)
                    self._gave_up(request_id, attempts, failed)
                    return _stand(failed)
                if attempts.retry(retry_reason(err)):
                    self._retrying(request_id, None, err.status, retry_reason(err))
                    silence = retry_reason(err) == ROUTE_TIMEOUT
                    if silence:
                        # the silent router may have handed the request over just before it stalled:
                        # another id, so that a worker holding both runs the retry too (not 409)
                        carried = f"{request_id}-{attempts.retries}"
                    continue
                raise
            attempts.tried_on(ex.worker_id)
            silence = False
            try:
                status, answer = await ex.start()
            except ApiError as err:
                ex.close()
                reason = retry_reason(err)
                if attempts.retry(reason):
                    attempts.failed_elsewhere(ex.worker_id, getattr(err, "failed_worker", ""))
                    ex.cancel("retry")  # nothing when the worker already ended the attempt
                    self._retrying(request_id, ex.worker_id, err.status, reason)
                    failed = err
                    continue
                self._gave_up(request_id, attempts, err)
                raise
            except asyncio.CancelledError:  # the client left (or the frontend stops) while the attempt runs
                ex.cancel(cancel_reason() if callable(cancel_reason) else cancel_reason)
                ex.close()
                raise
            except Exception:
                ex.cancel("error")
                ex.close()
                raise
            reason = engine_status_reason(status) if answer is not None else None
            if attempts.retry(reason):
                ex.close()
                self._retrying(request_id, ex.worker_id, status, reason)
                failed = ex
                continue
            if answer is not None:
                self._gave_up(request_id, attempts, ex)
            return ex

    def _gave_up(self, request_id: str, attempts: Attempts, failed: ApiError | Exchange) -> None:
        """The client gets a worker-side failure (no attempt left): a warning, the first of each status
        at once and then one every ``FAILURES_LOG_EVERY`` seconds with the count held back."""
        status = failed.status
        if status < 500:
            return
        held = self._failures.let_through(str(status), time.monotonic())
        if held is not None:
            error = failed.message if isinstance(failed, ApiError) else "the engine answered with an error"
            log.warning("request_failed_upstream", request_id=request_id, status=status, error=error,
                        workers=list(attempts.tried), **({"repeated": held} if held else {}))

    def _retrying(self, request_id: str, worker_id: str | None, status: int, reason: str | None) -> None:
        self.metrics.retries.labels(reason).inc()
        log.info("request_retried", request_id=request_id, failed_worker=worker_id, status=status, reason=reason)


def _stand(failed: ApiError | Exchange) -> Exchange:
    """The answer of a failed attempt when no retry could be placed: raise its error or return it."""
    if isinstance(failed, ApiError):
        raise failed
    return failed
