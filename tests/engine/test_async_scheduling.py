"""Async scheduling: step N+1 is scheduled while step N runs, and every request gets the same tokens."""

import pytest

from ascendserve import LLM, SamplingParams
from ascendserve.engine.kv_cache_manager import KVCacheManager
from ascendserve.engine.request import Request, RequestStatus
from ascendserve.engine.scheduler import Scheduler


def make(num_blocks=16, block_size=4, budget=16):
    return Scheduler(KVCacheManager(num_blocks, block_size, False), 4, budget, max_model_len=64)


def req(rid, n, max_tokens=4):
    return Request(rid, list(range(100, 100 + n)), SamplingParams(max_tokens=max_tokens),
                   eos_token_ids=frozenset({0}), max_tokens=max_tokens)


def plan(out):
    return [(s.request_id, s.token_ids, s.num_tokens, s.start_pos, s.sample) for s in out.scheduled]


def test_next_step_decodes_the_placeholder_the_running_step_samples():
    s = make()
    s.add_request(req("a", 3))
    first = s.schedule()
    second = s.schedule()  # scheduled before `first` has sampled
    assert plan(second) == [("a", [], 1, 3, True)]
    assert s.requests["a"].num_output_placeholders == 2
    s.update_from_output(first, {"a": 7})
    second.fill_placeholders()
    assert second.scheduled[0].token_ids == [7]
    s.update_from_output(second, {"a": 8})
    assert s.requests["a"].output_token_ids == [7, 8] and s.requests["a"].num_output_placeholders == 0


def test_no_step_is_scheduled_past_max_tokens():
    s = make()
    s.add_request(req("a", 3, max_tokens=2))
    first = s.schedule()
    second = s.schedule()
    assert s.schedule().is_empty()  # tokens 1 and 2 are already being sampled
    s.update_from_output(first, {"a": 7})
    updates = s.update_from_output(second, {"a": 8})
    assert updates[0].finished and s.requests == {}


def test_a_request_that_stops_while_its_next_step_is_scheduled():
    s = make()
    s.add_request(req("a", 3))
    first = s.schedule()
    second = s.schedule()
    updates = s.update_from_output(first, {"a": 0})  # EOS: finished and freed
    assert updates[0].finished and s.kv.pool.counts()[2] == 0
    second.fill_placeholders()
    assert second.scheduled[0].token_ids == [0]  # still runs; its result is discarded
    assert s.update_from_output(second, {"a": 5}) == []


def test_preempted_while_running_keeps_its_token_and_recomputes():
    # a and b take 2 blocks of 4 each; while step 1 (both prompts) runs, step 2 needs a 3rd block
    # for a, so b is preempted; b's token from step 1 still arrives and is kept.
    s = make(num_blocks=4, budget=64)
    s.add_request(req("a", 8, max_tokens=8))
    s.add_request(req("b", 7, max_tokens=8))
    first = s.schedule()
    second = s.schedule()
    assert second.preempted_request_ids == ["b"] and plan(second) == [("a", [], 1, 8, True)]
    b = s.waiting[0]
    assert b.num_computed_tokens == 0 and b.num_output_placeholders == 1
    s.update_from_output(first, {"a": 7, "b": 9})
    assert b.output_token_ids == [9] and b.status == RequestStatus.PREEMPTED
    assert b.num_output_placeholders == 0


def test_preempted_request_that_stops_leaves_the_waiting_queue():
    s = make(num_blocks=4, budget=64)
    s.add_request(req("a", 8, max_tokens=8))
    s.add_request(req("b", 7, max_tokens=8))
    first = s.schedule()
    s.schedule()
    updates = s.update_from_output(first, {"a": 7, "b": 0})
    assert [u.request.request_id for u in updates if u.finished] == ["b"]
    assert not s.waiting and "b" not in s.requests


@pytest.fixture(scope="module")
def engines():
    kw = dict(kv_cache_memory_bytes=64 << 20, max_model_len=512, max_num_batched_tokens=64, max_num_seqs=6)
    return LLM(**kw), LLM(**kw, async_scheduling=True)


def test_same_tokens_as_the_synchronous_loop(engines):
    sync, overlapped = engines
    prompts = ["Hello, my name is", "The capital of France is", "def fibonacci(n):",
               "Once upon a time, in a land far away, there lived a dragon who", "1, 2, 3, 4,",
               "Tell me a story", "Write a haiku about the sea.", "List three colors:"]
    params = [SamplingParams(temperature=0, max_tokens=24),  # may stop on EOS
              SamplingParams(temperature=0, max_tokens=30, stop=[" Paris", "."]),
              SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=20, logprobs=2),
              SamplingParams(temperature=0, max_tokens=1),
              SamplingParams(temperature=1.0, seed=3, max_tokens=16, n=2),
              SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[13], presence_penalty=0.5),
              SamplingParams(temperature=0.7, seed=5, max_tokens=12, min_tokens=10, frequency_penalty=0.3),
              SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)]
    expected = sync.generate(prompts, params, use_tqdm=False)
    got = overlapped.generate(prompts, params, use_tqdm=False)
    for e, g in zip(expected, got):
        assert [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in g.outputs] == \
               [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in e.outputs]
    assert got[2].outputs[0].logprobs is not None
    engine = overlapped.llm_engine
    free, cached, in_use = engine.kv_cache_manager.pool.counts()
    assert in_use == 0 and free + cached == engine.kv_cache_manager.num_blocks
