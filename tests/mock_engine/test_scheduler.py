"""Continuous batching policy, driven step by step without a clock."""

import itertools

import pytest

from infera_mock_engine.kv_events import BlockRemoved, BlockStored
from infera_mock_engine.prefix_cache import PrefixCache
from infera_mock_engine.scheduler import RUNNING, WAITING, Finished, Scheduler, SchedulerConfig, Sequence
from infera_mock_engine.timing import TimingModel


def make(max_running=8, budget=8192, blocks=1000, page=16, on_kv_events=None):
    kv = PrefixCache(blocks, page)
    return Scheduler(SchedulerConfig(max_running, budget), kv, TimingModel(), on_kv_events)


_prompt_bases = itertools.count(1)


def seq(rid, prompt_len, max_new=5, reason="length", prompt=None):
    """A sequence with its own prompt (distinct from every other's unless `prompt` is given)."""
    counter = itertools.count(100)
    base = 10_000 * next(_prompt_bases)
    ids = list(prompt) if prompt is not None else list(range(base, base + prompt_len))
    return Sequence(rid=rid, prompt_ids=ids, max_new_tokens=max_new, limit_reason=reason,
                    next_token=lambda: next(counter))


def drain(s: Sequence) -> list:
    out = []
    while not s.events.empty():
        out.append(s.events.get_nowait())
    return out


def run_step(sched: Scheduler):
    step = sched.plan_step()
    sched.finish_step(step)
    return step


def test_requests_are_batched_together_then_decode_one_token_per_step():
    sched = make()
    a, b = seq("a", 30), seq("b", 50)
    sched.add(a)
    sched.add(b)
    step = run_step(sched)
    assert step.prefill_tokens == 80 and step.decoding == 0
    assert drain(a) == [100] and drain(b) == [100]  # prefill step emits the first token
    step = run_step(sched)
    assert step.prefill_tokens == 0 and step.decoding == 2
    assert drain(a) == [101] and drain(b) == [101]


def test_a_request_joins_a_running_batch():
    sched = make()
    a = seq("a", 30, max_new=10)
    sched.add(a)
    run_step(sched)
    b = seq("b", 20)
    sched.add(b)
    step = run_step(sched)
    assert step.prefill_tokens == 20 and step.decoding == 1
    assert sched.num_running == 2


def test_step_time_follows_the_timing_model():
    sched = make(blocks=100, page=16)
    sched.add(seq("a", 100))
    step = sched.plan_step()
    assert step.seconds == pytest.approx(TimingModel().step_seconds(100, 0, 7 / 100))  # ceil(101/16)=7 blocks
    sched.finish_step(step)
    step = sched.plan_step()
    assert step.seconds == pytest.approx(TimingModel().decode_ms(7 / 100) / 1000)


def test_max_running_requests_makes_the_rest_wait_fifo():
    sched = make(max_running=1)
    a, b, c = seq("a", 10, max_new=2), seq("b", 10), seq("c", 10)
    for s in (a, b, c):
        sched.add(s)
    run_step(sched)
    assert (sched.num_running, sched.num_waiting) == (1, 2)
    assert b.state == WAITING and c.state == WAITING
    run_step(sched)  # a reaches max_new_tokens
    assert drain(a)[-1] == Finished("length")
    assert a.state == "finished"
    run_step(sched)
    assert b.state == RUNNING and c.state == WAITING


def test_prefill_is_chunked_by_the_token_budget():
    sched = make(budget=40)
    a = seq("a", 100)
    sched.add(a)
    sizes = []
    for _ in range(3):
        sizes.append(run_step(sched).prefill_tokens)
        if len(sizes) < 3:
            assert drain(a) == []  # no token before the prefill completes
    assert sizes == [40, 40, 20]
    assert drain(a) == [100]


def test_budget_exhausted_keeps_new_requests_waiting():
    sched = make(budget=64)
    sched.add(seq("a", 64))
    sched.add(seq("b", 10))
    step = sched.plan_step()
    assert step.prefill_tokens == 64
    assert sched.num_waiting == 1


def test_no_free_blocks_means_the_next_request_waits():
    sched = make(blocks=4, page=16)
    a = seq("a", 40, max_new=3)  # 3 blocks with its first token
    b = seq("b", 20)  # needs 2 blocks
    sched.add(a)
    sched.add(b)
    run_step(sched)
    assert a.state == RUNNING and b.state == WAITING
    assert sched.kv.used_blocks == 3


def test_decode_growth_preempts_the_newest_sequence_and_recomputes_it():
    sched = make(blocks=4, page=16)
    a = seq("a", 31, max_new=20)
    b = seq("b", 31, max_new=3)
    sched.add(a)
    sched.add(b)
    run_step(sched)  # both prefilled: 2 blocks each (32 tokens with the first output)
    assert sched.kv.used_blocks == 4
    run_step(sched)  # a grows to 33 tokens -> needs a 3rd block -> b (newest) is preempted
    assert b.state == WAITING and sched.stats.preemptions >= 1
    tokens_b = [e for e in drain(b) if not isinstance(e, Finished)]
    for _ in range(100):
        if b.state == "finished" and a.state == "finished":
            break
        run_step(sched)
        tokens_b += [e for e in drain(b) if not isinstance(e, Finished)]
    assert a.state == "finished" and b.state == "finished"
    assert len(tokens_b) == 3  # preemption loses no token and repeats none
    assert sched.kv.used_blocks == 0


def test_finish_frees_blocks_and_tells_the_consumer():
    sched = make()
    a = seq("a", 30, max_new=50)
    sched.add(a)
    run_step(sched)
    sched.finish(a, "abort", "bye")
    assert sched.num_running == 0 and sched.kv.used_blocks == 0
    assert drain(a)[-1] == Finished("abort", "bye")
    assert sched.plan_step().empty
    assert sched.stats.finished == {"abort": 1}


def test_finish_during_a_step_drops_its_results():
    sched = make()
    a = seq("a", 30, max_new=50)
    sched.add(a)
    step = sched.plan_step()
    sched.finish(a, "abort")
    sched.finish_step(step)
    assert [e for e in drain(a) if not isinstance(e, Finished)] == []
    assert sched.stats.prompt_tokens == 0


def test_limit_reached_finishes_with_its_reason_and_counts_tokens():
    sched = make()
    a = seq("a", 12, max_new=2, reason="stop")
    sched.add(a)
    run_step(sched)
    run_step(sched)
    assert drain(a) == [100, 101, Finished("stop")]
    assert (sched.stats.prompt_tokens, sched.stats.generation_tokens) == (12, 2)


def test_zero_new_tokens_is_prefill_only():
    sched = make()
    a = seq("a", 12, max_new=0)
    sched.add(a)
    run_step(sched)
    assert drain(a) == [Finished("length")]


async def test_the_loop_survives_a_failing_step_and_keeps_serving():
    import asyncio

    sched = Scheduler(SchedulerConfig(), PrefixCache(100, 16), TimingModel(speedup=1000))
    task = asyncio.create_task(sched.run())
    try:
        def boom() -> int:
            raise RuntimeError("bug")

        bad = Sequence(rid="bad", prompt_ids=[1, 2], max_new_tokens=3, limit_reason="length", next_token=boom)
        sched.add(bad)
        ended = await asyncio.wait_for(bad.events.get(), 5)
        assert ended.reason == "abort" and "internal error" in ended.message
        good = seq("good", 5, max_new=2)
        sched.add(good)
        got = [await asyncio.wait_for(good.events.get(), 5) for _ in range(3)]
        assert got == [100, 101, Finished("length")]
    finally:
        task.cancel()


async def test_a_steps_tokens_reach_their_streams_before_its_kv_events_are_published():
    """As on SGLang and vLLM, whose publisher thread encodes and sends the events: the prompt's
    BlockStored batch (a long prompt's is large) never delays its first token."""
    import asyncio

    order: list[str] = []
    sched = Scheduler(SchedulerConfig(), PrefixCache(100, 4), TimingModel(speedup=1000),
                      on_kv_events=lambda events: order.append(f"events {len(events)}"))
    a = seq("a", 16, max_new=1)

    async def stream() -> None:  # stands in for the request's HTTP handler
        order.append(f"token {await a.events.get()}")

    reader = asyncio.create_task(stream())
    task = asyncio.create_task(sched.run())
    try:
        await asyncio.sleep(0)  # the handler waits for its first token
        sched.add(a)
        await asyncio.wait_for(reader, 5)
        for _ in range(50):
            if len(order) > 1:
                break
            await asyncio.sleep(0.01)
        assert order == ["token 100", "events 1"]
    finally:
        task.cancel()


def run_to_end(sched: Scheduler, *seqs: Sequence, limit: int = 500) -> None:
    for _ in range(limit):
        if all(s.state == "finished" for s in seqs):
            return
        run_step(sched)
    raise AssertionError("sequences did not finish")


def test_a_repeated_prompt_is_charged_prefill_only_for_its_uncached_tokens():
    sched = make(page=16)
    prompt = list(range(500, 600))  # 100 tokens: 6 full blocks
    first = seq("first", 0, max_new=2, prompt=prompt)
    sched.add(first)
    step = sched.plan_step()
    assert step.prefill_tokens == 100 and step.seconds == pytest.approx(TimingModel().step_seconds(100, 0, step.kv_usage))
    sched.finish_step(step)
    run_to_end(sched, first)
    assert first.cached_tokens == 0
    again = seq("again", 0, max_new=2, prompt=prompt)
    sched.add(again)
    step = sched.plan_step()
    assert again.cached_tokens == 96  # 6 full blocks reused; the 4 tokens after them are computed
    assert step.prefill_tokens == 4
    assert step.seconds == pytest.approx(TimingModel().step_seconds(4, 0, step.kv_usage))
    sched.finish_step(step)
    run_to_end(sched, again)
    assert (sched.stats.prompt_tokens, sched.stats.cached_tokens) == (200, 96)


def test_a_prompt_sharing_only_a_prefix_reuses_only_that_prefix():
    sched = make(page=16)
    system = list(range(700, 740))  # 40 tokens: 2 full blocks
    a = seq("a", 0, max_new=1, prompt=system + [1, 2, 3])
    sched.add(a)
    run_to_end(sched, a)
    b = seq("b", 0, max_new=1, prompt=system + [9, 9, 9, 9, 9])
    sched.add(b)
    step = sched.plan_step()
    assert b.cached_tokens == 32 and step.prefill_tokens == 45 - 32


def test_each_step_publishes_its_kv_events_as_one_batch():
    batches = []
    sched = make(blocks=6, page=4, on_kv_events=batches.append)
    a = seq("a", 9, max_new=4)  # 9 prompt tokens: 2 full blocks stored by the prefill step
    sched.add(a)
    run_step(sched)
    sched.publish_kv_events()
    assert len(batches) == 1 and [type(e) for e in batches[0]] == [BlockStored]
    assert len(batches[0][0].block_hashes) == 2 and batches[0][0].token_ids == a.prompt_ids[:8]
    for _ in range(3):
        run_step(sched)
        sched.publish_kv_events()
    # by now a's 3rd block (prompt token 9 + 3 generated) was stored, chained to the 2nd
    stored = [e for batch in batches[1:] for e in batch if isinstance(e, BlockStored)]
    assert stored and stored[0].parent_block_hash == batches[0][0].block_hashes[-1]
    assert stored[0].token_ids == a.tokens[8:12]
    assert a.state == "finished"
    b = seq("b", 20, max_new=1)  # needs every block: a's cached ones are evicted, tail first
    sched.add(b)
    run_step(sched)
    sched.publish_kv_events()
    removed = [h for e in batches[-1] if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert removed == [stored[0].block_hashes[0], *reversed(batches[0][0].block_hashes)]


def test_a_preempted_sequence_recomputes_from_its_cached_blocks():
    sched = make(blocks=8, page=4)
    a = seq("a", 11, max_new=10)  # up to 6 blocks
    b = seq("b", 5, max_new=10)  # up to 4 blocks: both cannot finish together
    sched.add(a)
    sched.add(b)
    run_step(sched)
    for _ in range(20):
        run_step(sched)
        if b.state == WAITING:
            break
    assert b.state == WAITING and sched.stats.preemptions == 1
    assert sched.kv.match(b.tokens) == 8  # b's 2 full blocks stayed cached when it was preempted
    while b.state == WAITING:
        step = sched.plan_step()
        readmitted = [n for s, n in step.prefill if s is b]
        sched.finish_step(step)
    assert readmitted == [b.prefill_target - 8]  # only the tokens after the cached blocks are recomputed
    run_to_end(sched, a, b)
    assert len([t for t in drain(b) if not isinstance(t, Finished)]) == 10
    assert b.cached_tokens == 0  # reported reuse is the first admission's, not the recompute's
