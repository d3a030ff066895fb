"""The engine core the HTTP APIs share: validates a generation, runs it through the scheduler and
turns token ids into text deltas (stop strings, finish reasons). No HTTP here."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

from infera_mock_engine.block_hasher import BlockHasher, random_seed
from infera_mock_engine.config import EngineConfig
from infera_mock_engine.kv_publisher import KvEventPublisher
from infera_mock_engine.prefix_cache import PrefixCache
from infera_mock_engine.scheduler import Finished, Scheduler, SchedulerConfig, Sequence
from infera_mock_engine.stops import StopMatcher
from infera_mock_engine.textgen import TokenStream, WordVocab, stream_seed
from infera_mock_engine.timing import TimingModel
from infera_mock_engine.tokenizer import ModelTokenizer


class RequestError(Exception):
    """A request the engine refuses (HTTP 400 unless `status` says otherwise)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param


@dataclass
class GenerationParams:
    rid: str
    prompt_ids: list[int]
    max_new_tokens: int | None = None  # None: the mock's natural length (see README)
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    temperature: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    internal: bool = False


@dataclass
class Output:
    """New text/tokens since the previous Output; the last one carries the finish reason."""

    text: str
    token_ids: list[int]
    completion_tokens: int
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    matched_stop: str | int | None = None
    message: str = ""


class GenerationStream:
    """Async iterator of Outputs; leaving its `async with` block early aborts the sequence."""

    def __init__(self, engine: Engine, seq: Sequence, params: GenerationParams) -> None:
        self.engine = engine
        self.seq = seq
        self.params = params
        self.prompt_tokens = len(params.prompt_ids)
        self.cached_tokens = 0
        self.completion_tokens = 0
        self.done = False
        self._stops = StopMatcher(params.stop)
        self._stop_ids = set(params.stop_token_ids)

    async def __aenter__(self) -> GenerationStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if not self.done:
            self.done = True
            self.engine.scheduler.finish(self.seq, "abort", "client gone")
        self.engine._forget(self.seq)

    def __aiter__(self) -> GenerationStream:
        return self

    async def __anext__(self) -> Output:
        if self.done:
            raise StopAsyncIteration
        events = [await self.seq.events.get()]
        while not self.seq.events.empty():  # coalesce tokens that piled up while the client was slow
            events.append(self.seq.events.get_nowait())
        self.cached_tokens = self.seq.cached_tokens
        text: list[str] = []
        ids: list[int] = []
        for ev in events:
            if isinstance(ev, Finished):
                return self._finish(text, ids, ev.reason, self._eos_match(ev.reason), ev.message)
            ids.append(ev)
            self.completion_tokens += 1
            if ev in self._stop_ids:
                self.engine.scheduler.finish(self.seq, "stop")
                return self._finish(text, ids, "stop", ev)
            safe, matched = self._stops.feed(self.engine.vocab.piece(ev))
            text.append(safe)
            if matched is not None:
                self.engine.scheduler.finish(self.seq, "stop")
                return self._finish(text, ids, "stop", matched, flush=False)
        return Output("".join(text), ids, self.completion_tokens)

    def _eos_match(self, reason: str) -> int | None:
        return self.engine.eos_token_id if reason == "stop" else None

    def _finish(self, text: list[str], ids: list[int], reason: str, matched: str | int | None,
                message: str = "", flush: bool = True) -> Output:
        if flush:
            text.append(self._stops.flush())
        self.done = True
        self.engine._forget(self.seq)
        return Output("".join(text), ids, self.completion_tokens, reason, matched, message)

    async def collect(self) -> tuple[str, list[int], Output]:
        """Run to the end: (full text, all token ids, the last Output)."""
        text: list[str] = []
        ids: list[int] = []
        last = None
        async for out in self:
            text.append(out.text)
            ids.extend(out.token_ids)
            last = out
        assert last is not None
        return "".join(text), ids, last


class Engine:
    def __init__(self, config: EngineConfig, tokenizer: ModelTokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.vocab = WordVocab(tokenizer.vocab, tokenizer.decode)
        eos = tokenizer.special.get("eos_token")
        self.eos_token_id = tokenizer.tokenizer.token_to_id(eos) if eos else None
        hasher = BlockHasher(random_seed(config.kv_hash_seed), signed=config.engine_flavor == "sglang")
        self.kv = PrefixCache(config.num_kv_blocks, config.page_size, hasher)
        self.timing = TimingModel(speedup=config.speedup)
        self.publisher: KvEventPublisher | None = None
        if config.kv_events is not None and config.publishes_kv_events:
            self.publisher = KvEventPublisher(config.kv_events, config.engine_flavor, config.page_size, dp_rank=0)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_running_requests, config.max_num_batched_tokens), self.kv, self.timing,
            on_kv_events=self.publisher.publish if self.publisher else None,
        )
        self.ready = asyncio.Event()
        self._by_rid: dict[str, set[Sequence]] = {}
        self._task: asyncio.Task | None = None

    # ---- lifecycle -------------------------------------------------------------
    async def start(self) -> None:
        if self.publisher is not None:
            self.publisher.start()  # raises PublisherError: the engine does not start
        self._task = asyncio.create_task(self.scheduler.run(), name="mock-engine-scheduler")
        if self.config.startup_delay > 0:
            asyncio.get_running_loop().call_later(self.config.startup_delay, self.ready.set)
        else:
            self.ready.set()

    async def stop(self) -> None:
        self.scheduler.abort_all()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.publisher is not None:
            await self.publisher.close()

    # ---- requests ----------------------------------------------------------------
    def validate(self, params: GenerationParams) -> tuple[int, str]:
        """Check a generation; returns (token limit, finish reason at the limit)."""
        n = len(params.prompt_ids)
        ctx = self.config.context_length
        if n == 0:
            raise RequestError("the prompt is empty", param="prompt")
        vocab_size = self.tokenizer.vocab_size
        bad = next((t for t in params.prompt_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise RequestError(f"token id {bad} is out of the vocabulary (size {vocab_size})", param="prompt")
        if n >= ctx:
            raise RequestError(
                f"the prompt has {n} tokens; this model's context length is {ctx} tokens", param="messages"
            )
        if params.max_new_tokens is not None:
            if n + params.max_new_tokens > ctx:
                raise RequestError(
                    f"this model's maximum context length is {ctx} tokens, but {n + params.max_new_tokens} "
                    f"were requested ({n} in the prompt, {params.max_new_tokens} in the completion)",
                    param="max_tokens",
                )
            limit, reason = params.max_new_tokens, "length"
        elif params.ignore_eos or self.config.mock_output_len > ctx - n:
            limit, reason = ctx - n, "length"
        else:
            limit, reason = self.config.mock_output_len, "stop"
        if not self.kv.fits_at_all(n + limit):
            raise RequestError(
                f"the request needs {self.kv.blocks_for(n + limit)} KV blocks ({n} prompt + {limit} output "
                f"tokens); this engine has {self.kv.num_blocks}",
                param="max_tokens",
            )
        return limit, reason

    def submit(self, params: GenerationParams) -> GenerationStream:
        """Queue a generation (raises RequestError if invalid); use the result as `async with`."""
        limit, reason = self.validate(params)
        seed = stream_seed(params.prompt_ids, params.seed, params.temperature)
        seq = Sequence(
            rid=params.rid,
            prompt_ids=list(params.prompt_ids),
            max_new_tokens=limit,
            limit_reason=reason,
            next_token=TokenStream(self.vocab, seed),
            internal=params.internal,
        )
        self._by_rid.setdefault(params.rid, set()).add(seq)
        self.scheduler.add(seq)
        return GenerationStream(self, seq, params)

    def abort(self, rid: str) -> int:
        """Abort every in-flight sequence with this request id (also accepts `chatcmpl-`/`cmpl-` ids)."""
        seqs = self._by_rid.get(rid)
        if not seqs:
            for prefix in ("chatcmpl-", "cmpl-"):
                if rid.startswith(prefix) and rid[len(prefix):] in self._by_rid:
                    seqs = self._by_rid[rid[len(prefix):]]
                    break
        for seq in list(seqs or ()):
            self.scheduler.finish(seq, "abort", "aborted by /abort_request")
        return len(seqs or ())

    def abort_all(self) -> int:
        return self.scheduler.abort_all()

    # ---- the prefix cache ----------------------------------------------------------
    def flush_cache(self) -> bool:
        """SGLang /flush_cache: drop every cached block, only when no request is running or waiting."""
        if self.scheduler.num_running or self.scheduler.num_waiting:
            return False
        return self._clear_cache()

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """vLLM /reset_prefix_cache: refused while blocks are in use, unless running requests are
        preempted first (they recompute afterwards)."""
        if reset_running_requests:
            self.scheduler.preempt_all()
        return self._clear_cache()

    def _clear_cache(self) -> bool:
        ok = self.kv.clear()
        self.scheduler.publish_kv_events()  # AllBlocksCleared goes out at once, after any pending events
        return ok

    def _forget(self, seq: Sequence) -> None:
        seqs = self._by_rid.get(seq.rid)
        if seqs is not None:
            seqs.discard(seq)
            if not seqs:
                del self._by_rid[seq.rid]
