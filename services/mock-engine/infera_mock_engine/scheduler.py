"""Continuous-batching scheduler loop with a GPU-like timing model.

Per step: sequences already decoding each grow by one token (preempting the newest running
sequence back to the queue when KV blocks run out, as vLLM does); sequences still prefilling get
their next chunk; then waiting sequences are admitted in FIFO order while there is a running slot,
prefill token budget and KV blocks for their prompt. Admission reuses the prompt's cached prefix
(`PrefixCache.admit`): only the uncached tokens are prefilled, and only they cost prefill time.
The step costs `TimingModel.step_seconds` (divided by the speedup); at its end the blocks the step
filled are cached (`PrefixCache.commit`) and every sequence whose prefill completed or that was
decoding emits one token. The KV events of one step (evictions while planning, stores at its end)
go out as one batch through `on_kv_events`. With nothing to do the loop blocks on an event.

`plan_step`/`finish_step` are synchronous and deterministic, so the policy is testable without a
clock; `run` is the thin async loop around them.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from infera_mock_engine.kv_events import Adapter, KvEvent
from infera_mock_engine.prefix_cache import PrefixCache
from infera_mock_engine.timing import TimingModel, step_start

log = logging.getLogger("infera_mock_engine.scheduler")

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"
_ids = itertools.count()


@dataclass(frozen=True)
class Finished:
    """Last event of a sequence: why it ended ("length", "stop", "abort")."""

    reason: str
    message: str = ""


@dataclass(eq=False)
class Sequence:
    rid: str
    prompt_ids: list[int]
    max_new_tokens: int
    limit_reason: str  # finish reason when max_new_tokens is reached: "length", or "stop" (simulated EOS)
    next_token: Callable[[], int]
    internal: bool = False  # health probes: not counted in the token counters
    preloaded: int = 0  # prompt tokens whose KV arrived from a prefill engine (PD decode): not computed here
    lora: Adapter | None = None  # the LoRA adapter it runs under (None: the base model)
    salt: str | None = None  # its request's cache_salt: a prefix cache only the same salt reuses
    key: int = field(default_factory=lambda: next(_ids))
    state: str = WAITING
    prefill_target: int = 0  # tokens to (re)compute before decoding: prompt (+ generated after preemption)
    prefilled: int = 0
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache at first admission
    generated: int = 0
    admitted: bool = False
    prompt_counted: bool = False
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # token ids, then one Finished
    tokens: list[int] = field(default_factory=list)  # prompt + generated ids (what the KV cache holds)

    def __post_init__(self) -> None:
        self.prefill_target = len(self.prompt_ids)
        self.tokens = list(self.prompt_ids)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def total_len(self) -> int:
        return self.prompt_len + self.generated

    @property
    def decoding(self) -> bool:
        return self.state == RUNNING and self.prefilled >= self.prefill_target


@dataclass
class SchedulerConfig:
    max_running_requests: int = 256
    max_num_batched_tokens: int = 8192
    overlap: bool = True  # SGLang's overlap schedule (timing.step_start); --disable-overlap-schedule turns it off
    # SGLang counts a request's prompt, cached and generated tokens when it ends; vLLM as each step makes them
    count_at_finish: bool = False


@dataclass
class Step:
    """What one step computes: prefill chunks (sequence, tokens) and the sequences that emit a token."""

    prefill: list[tuple[Sequence, int]] = field(default_factory=list)
    emit: list[Sequence] = field(default_factory=list)
    prefill_tokens: int = 0
    decoding: int = 0
    kv_usage: float = 0.0
    seconds: float = 0.0

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.emit


@dataclass
class Stats:
    """Monotonic counters read by /metrics."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    cached_tokens: int = 0
    preemptions: int = 0
    finished: dict[str, int] = field(default_factory=dict)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: PrefixCache, timing: TimingModel,
                 on_kv_events: Callable[[list[KvEvent]], None] | None = None) -> None:
        self.config = config
        self.kv = kv
        self.timing = timing
        self.on_kv_events = on_kv_events
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.stats = Stats()
        self._wake = asyncio.Event()
        self._arrived = float("-inf")  # loop time of the latest request added
        self._gpu_answers = asyncio.Event()  # cleared while the simulated GPU hangs (`hang`)
        self._gpu_answers.set()
        self._held: list[Callable[[], None]] = []  # arrivals and aborts made while hung, in order
        self.outputs = 0  # steps that produced a token or finished a sequence (SGLang's health test)

    # ---- a simulated GPU hang ----------------------------------------------------
    def hang(self) -> None:
        """The GPU stops returning steps: the step under way never ends, no token or event goes
        out, while HTTP keeps answering (a wedged kernel or collective: the process lives, its
        scheduler waits forever). Requests that arrive and aborts wait for the scheduler as they
        do in SGLang and vLLM, which take them in between steps, so the gauges keep their last
        values: what the engine held stays counted even after its clients left."""
        self._gpu_answers.clear()

    def resume(self) -> None:
        self._gpu_answers.set()
        held, self._held = self._held, []
        for apply in held:
            apply()

    @property
    def hung(self) -> bool:
        return not self._gpu_answers.is_set()

    # ---- requests in and out -------------------------------------------------
    def _between_steps(self, apply: Callable[[], None]) -> None:
        """Apply an arrival or an abort now, or, while the GPU hangs, once the hang ends."""
        if self.hung:
            self._held.append(apply)
        else:
            apply()

    def add(self, seq: Sequence) -> None:
        self._between_steps(lambda: self._add(seq))

    def abort(self, seq: Sequence, message: str) -> None:
        """A client's abort, taken in between steps (so, while hung, once the hang ends)."""
        self._between_steps(lambda: self.finish(seq, "abort", message))

    def _add(self, seq: Sequence) -> None:
        try:
            self._arrived = asyncio.get_running_loop().time()
        except RuntimeError:  # no loop: a test driving plan_step/finish_step itself
            pass
        seq.state = WAITING
        self.waiting.append(seq)
        self._wake.set()

    def finish(self, seq: Sequence, reason: str, message: str = "") -> None:
        """End `seq` now (abort, stop string, limit): free its blocks, tell its consumer."""
        if seq.state == FINISHED:
            return
        if seq.state == RUNNING:
            self.running.remove(seq)
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        self.kv.release(seq.key)
        seq.state = FINISHED
        if not seq.internal:
            self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1
            if self.config.count_at_finish:
                self.stats.prompt_tokens += seq.prompt_len
                self.stats.cached_tokens += seq.cached_tokens
                self.stats.generation_tokens += seq.generated
        seq.events.put_nowait(Finished(reason, message))

    def abort_all(self, message: str = "aborted") -> int:
        seqs = list(self.running) + list(self.waiting)
        for seq in seqs:
            self.finish(seq, "abort", message)
        return len(seqs)

    def preempt_all(self) -> int:
        """Send every running sequence back to the queue (they recompute later); frees their blocks."""
        victims = list(reversed(self.running))
        for seq in victims:
            self._preempt(seq)
        return len(victims)

    def publish_kv_events(self) -> None:
        """Hand the KV events recorded since the last call to `on_kv_events` as one batch (in order:
        every call takes all that is pending, so a call made out of turn only makes a batch larger)."""
        events = self.kv.take_events()
        if events and self.on_kv_events is not None:
            try:
                self.on_kv_events(events)
            except Exception:  # noqa: BLE001 - publishing must never stall generation
                log.exception("publishing %d KV events failed", len(events))

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ---- the policy (synchronous) -------------------------------------------
    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.release(seq.key)
        seq.state = WAITING
        seq.prefill_target = seq.total_len
        seq.prefilled = 0
        seq.preloaded = 0  # its transferred KV is gone with its blocks: recompute
        self.waiting.appendleft(seq)
        self.stats.preemptions += 1
        log.debug("preempted %s at %d tokens", seq.rid, seq.total_len)

    def _grow_decoding(self) -> list[Sequence]:
        """Reserve one more token's slot for each decoding sequence, preempting newest-first."""
        decoders = [s for s in self.running if s.decoding]
        ready: list[Sequence] = []
        for seq in decoders:
            if seq.state != RUNNING:
                continue  # preempted as a victim of an earlier sequence
            while not self.kv.grow(seq.key, seq.total_len + 1):
                self._preempt(self.running[-1])
                if seq.state != RUNNING:
                    break
            if seq.state == RUNNING:
                ready.append(seq)
        return ready

    def plan_step(self) -> Step:
        step = Step()
        step.emit = self._grow_decoding()
        step.decoding = len(step.emit)
        budget = self.config.max_num_batched_tokens
        for seq in self.running:
            if budget <= 0:
                break
            if not seq.decoding:
                chunk = min(seq.prefill_target - seq.prefilled, budget)
                step.prefill.append((seq, chunk))
                budget -= chunk
        while self.waiting and budget > 0 and len(self.running) < self.config.max_running_requests:
            seq = self.waiting[0]
            hit = self.kv.admit(seq.key, seq.tokens, seq.prefill_target + 1, seq.lora, seq.salt)
            if hit is None:
                break  # FIFO: the head waits for blocks, nobody overtakes it
            self.waiting.popleft()
            seq.state = RUNNING
            # a cache hit leaves the last prompt token to compute; KV transferred from a prefill may cover all
            seq.prefilled = max(hit, min(seq.preloaded, seq.prefill_target))
            if not seq.admitted:
                seq.admitted = True
                seq.cached_tokens = hit
            self.running.append(seq)
            chunk = min(seq.prefill_target - seq.prefilled, budget)
            step.prefill.append((seq, chunk))
            budget -= chunk
        step.prefill_tokens = sum(n for _, n in step.prefill)
        step.kv_usage = self.kv.usage
        step.seconds = self.timing.step_seconds(step.prefill_tokens, step.decoding, step.kv_usage)
        return step

    def finish_step(self, step: Step) -> None:
        """Apply a step's results after its time has passed (sequences finished meanwhile are skipped)."""
        emit = [s for s in step.emit if s.state == RUNNING]
        for seq, chunk in step.prefill:
            if seq.state != RUNNING:
                continue
            seq.prefilled += chunk
            self.kv.commit(seq.key, seq.tokens, seq.prefilled)
            if seq.prefilled >= seq.prefill_target:
                if not seq.prompt_counted:
                    seq.prompt_counted = True
                    if not seq.internal and not self.config.count_at_finish:
                        self.stats.prompt_tokens += seq.prompt_len
                        self.stats.cached_tokens += seq.cached_tokens
                emit.append(seq)
        if emit:
            self.outputs += 1
        for seq in emit:
            if seq.state != RUNNING:
                continue
            self.kv.commit(seq.key, seq.tokens, len(seq.tokens))  # the step computed every token so far
            if seq.generated >= seq.max_new_tokens:  # max_new_tokens == 0: prefill only
                self.finish(seq, seq.limit_reason)
                continue
            token = seq.next_token()
            seq.tokens.append(token)
            seq.generated += 1
            if not seq.internal and not self.config.count_at_finish:
                self.stats.generation_tokens += 1
            seq.events.put_nowait(token)
            if seq.generated >= seq.max_new_tokens:
                self.finish(seq, seq.limit_reason)

    # ---- the loop ------------------------------------------------------------
    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        due: float | None = None  # when the step before was due to end, while steps follow one another
        last = 0.0  # that step's length
        while True:
            if not self.running and not self.waiting:
                due = None
                self._wake.clear()
                await self._wake.wait()
                continue
            t0 = step_start(loop.time(), due, last, self.config.overlap, self._arrived)
            try:
                step = self.plan_step()
            except Exception:  # noqa: BLE001 - a bug must not stall every request: fail them, keep serving
                log.exception("scheduler step failed; aborting in-flight requests")
                self.abort_all("internal error in the mock engine's scheduler")
                continue
            if step.empty:  # everything left waits for blocks held by nobody: cannot happen; don't spin
                due = None
                self._wake.clear()
                await self._wake.wait()
                continue
            due, last = t0 + step.seconds, step.seconds
            await asyncio.sleep(max(0.0, due - loop.time()))
            if self.hung:
                await self._gpu_answers.wait()
                due = None  # the clock starts afresh after a hang
            try:
                self.finish_step(step)
            except Exception:  # noqa: BLE001
                log.exception("scheduler step failed; aborting in-flight requests")
                self.abort_all("internal error in the mock engine's scheduler")
            # after the step's tokens go out (their streams were woken first): SGLang and vLLM encode
            # and send KV events on a publisher thread, off the path of the tokens
            loop.call_soon(self.publish_kv_events)
