"""The engine core the HTTP APIs share: validates a generation, runs it on one of its DP ranks'
scheduler (through a PD session when it is one half of a disaggregated request) and turns token ids
into text deltas (stop strings, finish reasons). No HTTP here."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from dataclasses import dataclass, field

from infera_mock_engine.block_hasher import BlockHasher, random_seed
from infera_mock_engine.config import EngineConfig
from infera_mock_engine.engine_errors import GenerationFailed, RequestError  # noqa: F401 - re-exported
from infera_mock_engine.kv_publisher import KvEventPublisher
from infera_mock_engine.kv_events import Adapter
from infera_mock_engine.lora import LoraRegistry
from infera_mock_engine.pd_engine import Disaggregation
from infera_mock_engine.pd_request import Routing
from infera_mock_engine.pd_session import PdSession
from infera_mock_engine.prefix_cache import PrefixCache
from infera_mock_engine.ranks import EngineRank, Totals, pick_rank, totals
from infera_mock_engine.scheduler import Finished, Scheduler, SchedulerConfig, Sequence
from infera_mock_engine.stops import StopMatcher
from infera_mock_engine.textgen import TokenStream, WordVocab, stream_seed
from infera_mock_engine.timing import TimingModel
from infera_mock_engine.tokenizer import ModelTokenizer


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
    routing: Routing | None = None  # DP rank pin and PD half (pd_request.routing)
    prompt_param: str = "prompt"  # the body field a refused prompt is blamed on ("messages" for chat)
    sample: int = 0  # which of the request's n samples of this prompt (OpenAI `n`)
    lora: Adapter | None = None  # the LoRA adapter the request names (None: the base model)
    cache_salt: str | None = None  # the request's cache_salt (vLLM, SGLang)


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

    def __init__(self, engine: Engine, seq: Sequence, params: GenerationParams, rank: EngineRank,
                 session: PdSession | None = None) -> None:
        self.engine = engine
        self.seq = seq
        self.params = params
        self.rank = rank
        self.session = session
        self._events = session.out if session is not None else seq.events
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
            self.abort("client gone")
        self.engine._forget(self)

    def abort(self, message: str) -> None:
        """End the generation now (its output ends with finish reason abort)."""
        if self.session is not None:
            self.session.abort(message)
        else:
            self.rank.scheduler.abort(self.seq, message)

    def __aiter__(self) -> GenerationStream:
        return self

    async def __anext__(self) -> Output:
        if self.done:
            raise StopAsyncIteration
        events = [await self._events.get()]
        while not self._events.empty():  # coalesce tokens that piled up while the client was slow
            events.append(self._events.get_nowait())
        self.cached_tokens = self.seq.cached_tokens
        text: list[str] = []
        ids: list[int] = []
        for ev in events:
            if isinstance(ev, Finished):
                if ev.reason == "error":  # the PD session failed (KV transfer / bootstrap)
                    self.done = True
                    self.engine._forget(self)
                    raise GenerationFailed(ev.message, err_type="500" if self._sglang else None)
                return self._finish(text, ids, ev.reason, self._eos_match(ev.reason), ev.message)
            ids.append(ev)
            self.completion_tokens += 1
            if ev in self._stop_ids:
                self.rank.scheduler.finish(self.seq, "stop")
                return self._finish(text, ids, "stop", ev)
            safe, matched = self._stops.feed(self.engine.vocab.piece(ev))
            text.append(safe)
            if matched is not None:
                self.rank.scheduler.finish(self.seq, "stop")
                return self._finish(text, ids, "stop", matched, flush=False)
        return Output("".join(text), ids, self.completion_tokens)

    @property
    def _sglang(self) -> bool:
        return self.engine.config.engine_flavor == "sglang"

    def _eos_match(self, reason: str) -> int | None:
        return self.engine.eos_token_id if reason == "stop" else None

    def _finish(self, text: list[str], ids: list[int], reason: str, matched: str | int | None,
                message: str = "", flush: bool = True) -> Output:
        if flush:
            text.append(self._stops.flush())
        self.done = True
        self.engine._forget(self)
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
        self.lora = LoraRegistry(config.lora_modules, config.served_model_names, config.enable_lora)
        self.tokenizer = tokenizer
        self.vocab = WordVocab(tokenizer.vocab, tokenizer.decode)
        eos = tokenizer.special.get("eos_token")
        self.eos_token_id = tokenizer.tokenizer.token_to_id(eos) if eos else None
        self.timing = TimingModel(speedup=config.speedup)
        hasher = BlockHasher(random_seed(config.kv_hash_seed), signed=config.engine_flavor == "sglang")
        self.ranks = [self._make_rank(r, hasher) for r in range(config.dp_size)]
        self.pd: Disaggregation | None = Disaggregation(config) if config.disagg.enabled else None
        self.ready = asyncio.Event()
        self._by_rid: dict[str, set[GenerationStream]] = {}
        self._round_robin = 0
        self.bootstrap_sock: socket.socket | None = None  # a prefill's bootstrap port, bound by main

    def _make_rank(self, dp_rank: int, hasher: BlockHasher) -> EngineRank:
        config = self.config
        kv = PrefixCache(config.num_kv_blocks, config.page_size, hasher)
        publisher = None
        if config.kv_events is not None and config.publishes_kv_events:
            publisher = KvEventPublisher(config.kv_events, config.engine_flavor, config.page_size, dp_rank=dp_rank)
        scheduler = Scheduler(
            SchedulerConfig(config.max_running_requests, config.max_num_batched_tokens,
                            overlap=not config.disable_overlap_schedule,
                            count_at_finish=config.engine_flavor == "sglang"), kv, self.timing,
            on_kv_events=publisher.publish if publisher else None,
        )
        return EngineRank(dp_rank, kv, scheduler, publisher)

    # DP rank 0's parts (the whole engine when dp_size is 1)
    @property
    def kv(self) -> PrefixCache:
        return self.ranks[0].kv

    @property
    def scheduler(self) -> Scheduler:
        return self.ranks[0].scheduler

    @property
    def publisher(self) -> KvEventPublisher | None:
        return self.ranks[0].publisher

    @property
    def publishers(self) -> list[KvEventPublisher]:
        return [r.publisher for r in self.ranks if r.publisher is not None]

    def totals(self) -> Totals:
        t = totals(self.ranks)
        if self.pd is not None:
            q = self.pd.queues()
            t.pd_pending = q["prefill_bootstrap"] + q["decode_prealloc"] + q["decode_transfer"]
        return t

    # ---- lifecycle -------------------------------------------------------------
    async def start(self) -> None:
        """Open the KV-event sockets (PublisherError) and the bootstrap port (BootstrapError; on
        `bootstrap_sock` when main bound it early), then run every rank's scheduler."""
        try:
            for pub in self.publishers:
                pub.start()
            if self.pd is not None:
                await self.pd.start(self.bootstrap_sock)
        except BaseException:
            for pub in self.publishers:
                await pub.close()
            raise
        for rank in self.ranks:
            rank.task = asyncio.create_task(rank.scheduler.run(), name=f"mock-engine-scheduler-{rank.dp_rank}")
        if self.config.startup_delay > 0:
            asyncio.get_running_loop().call_later(self.config.startup_delay, self.ready.set)
        else:
            self.ready.set()

    async def stop(self) -> None:
        self.abort_all("the engine is stopping")
        if self.pd is not None:
            await self.pd.stop()
        for rank in self.ranks:
            if rank.task is not None:
                rank.task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await rank.task
        for pub in self.publishers:
            await pub.close()

    def hang_gpu(self) -> None:
        """Simulate a hung GPU (SIGUSR1) on every rank, or on ``--hang-ranks``: see ``Scheduler.hang``."""
        hang = self.config.hang_ranks
        for rank in self.ranks:
            if hang is None or rank.dp_rank in hang:
                rank.scheduler.hang()

    def resume_gpu(self) -> None:
        """End a simulated hang (SIGUSR2): the step under way completes and serving goes on."""
        for rank in self.ranks:
            rank.scheduler.resume()

    # ---- requests ----------------------------------------------------------------
    def validate(self, params: GenerationParams) -> tuple[int, str]:
        """Check a generation; returns (token limit, finish reason at the limit)."""
        n = len(params.prompt_ids)
        ctx = self.config.context_length
        if n == 0:
            raise RequestError("the prompt is empty", param="prompt")
        vocab_size = self.tokenizer.vocab_size
        ids = params.prompt_ids
        if min(ids) < 0 or max(ids) >= vocab_size:  # in C first: one by one took ~0.8 ms for 16k ids
            bad = next(t for t in ids if not 0 <= t < vocab_size)
            raise RequestError(f"token id {bad} is out of the vocabulary (size {vocab_size})", param="prompt")
        if n >= ctx:
            raise RequestError(
                f"the prompt has {n} tokens; this model's context length is {ctx} tokens", param=params.prompt_param
            )
        if params.max_new_tokens is not None and self.config.engine_flavor == "vllm":
            # vLLM cuts max_tokens to what the prompt leaves of the context; only more than the
            # context length itself is an error
            if params.max_new_tokens > ctx:
                raise RequestError(
                    f"max_tokens={params.max_new_tokens} cannot be greater than max_model_len={ctx}. "
                    "Please request fewer output tokens.", param="max_tokens",
                )
            limit, reason = min(params.max_new_tokens, ctx - n), "length"
        elif params.max_new_tokens is not None:
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

    def _rank_for(self, routing: Routing | None) -> EngineRank:
        routing = routing or Routing()
        room = routing.pd.room if routing.pd is not None else None
        queues = None
        if self.config.engine_flavor == "vllm":
            queues = [(r.scheduler.num_waiting, r.scheduler.num_running) for r in self.ranks]
        index = pick_rank(self.config.dp_size, pinned=routing.dp_rank, room=room, round_robin=self._round_robin,
                          pinned_by=routing.dp_rank_field, queues=queues)
        if routing.dp_rank is None and room is None:
            self._round_robin += 1
        return self.ranks[index]

    def submit(self, params: GenerationParams) -> GenerationStream:
        """Queue a generation (raises RequestError if invalid); use the result as `async with`."""
        limit, reason = self.validate(params)
        rank = self._rank_for(params.routing)
        seed = stream_seed(params.prompt_ids, params.seed, params.temperature)
        if params.sample and seed is not None and params.temperature > 0:  # greedy samples all agree
            seed = hash((seed, params.sample)) & 0xFFFF_FFFF_FFFF_FFFF
        seq = Sequence(
            rid=params.rid,
            prompt_ids=list(params.prompt_ids),
            max_new_tokens=limit,
            limit_reason=reason,
            next_token=TokenStream(self.vocab, seed),
            internal=params.internal,
            lora=params.lora,
            salt=params.cache_salt,
        )
        pd = params.routing.pd if params.routing is not None else None
        session = None
        if pd is not None and self.pd is not None and not params.internal:
            session = self.pd.session(seq, params.rid, rank, pd)
        stream = GenerationStream(self, seq, params, rank, session)
        self._by_rid.setdefault(params.rid, set()).add(stream)
        if session is None:
            rank.scheduler.add(seq)
        else:
            session.start()
        return stream

    def abort(self, rid: str) -> int:
        """Abort every in-flight generation with this request id (also accepts `chatcmpl-`/`cmpl-` ids)."""
        streams = self._by_rid.get(rid)
        if not streams:
            for prefix in ("chatcmpl-", "cmpl-"):
                if rid.startswith(prefix) and rid[len(prefix):] in self._by_rid:
                    streams = self._by_rid[rid[len(prefix):]]
                    break
        for stream in list(streams or ()):
            stream.abort("aborted by /abort_request")
        return len(streams or ())

    def abort_all(self, message: str = "aborted") -> int:
        n = 0
        for streams in list(self._by_rid.values()):
            for stream in list(streams):
                stream.abort(message)
                n += 1
        return n + sum(rank.scheduler.abort_all(message) for rank in self.ranks)

    # ---- the prefix cache ----------------------------------------------------------
    def flush_cache(self) -> bool:
        """SGLang /flush_cache: drop every cached block, only when no request is running or waiting."""
        t = self.totals()
        if t.running or t.waiting:
            return False
        return self._clear_cache()

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """vLLM /reset_prefix_cache: refused while blocks are in use, unless running requests are
        preempted first (they recompute afterwards)."""
        if reset_running_requests:
            for rank in self.ranks:
                rank.scheduler.preempt_all()
        return self._clear_cache()

    def _clear_cache(self) -> bool:
        ok = True
        for rank in self.ranks:
            ok = rank.kv.clear() and ok
            rank.scheduler.publish_kv_events()  # AllBlocksCleared goes out at once, after any pending events
        return ok

    def _forget(self, stream: GenerationStream) -> None:
        streams = self._by_rid.get(stream.params.rid)
        if streams is not None:
            streams.discard(stream)
            if not streams:
                del self._by_rid[stream.params.rid]
