"""The scheduler on plain Python: token budgets, chunked prefill, admission order and preemption."""

from ascendserve.engine.kv_cache_manager import KVCacheManager
from ascendserve.engine.request import Request, RequestStatus
from ascendserve.engine.sampling_params import SamplingParams
from ascendserve.engine.scheduler import Scheduler
from ascendserve.engine.state_cache_manager import StateCacheManager


def make(num_blocks=16, block_size=4, budget=16, max_seqs=4, caching=False, chunked=True, state_slots=None):
    kv = KVCacheManager(num_blocks, block_size, caching)
    state = StateCacheManager(state_slots) if state_slots else None
    return Scheduler(kv, max_seqs, budget, max_model_len=64, enable_chunked_prefill=chunked,
                     state_cache_manager=state)


def req(rid, n, max_tokens=4, **kw):
    return Request(rid, list(range(100, 100 + n)), SamplingParams(max_tokens=max_tokens, **kw),
                   eos_token_ids=frozenset({0}), max_tokens=max_tokens)


def plan(out):
    return [(s.request_id, len(s.token_ids), s.start_pos, s.sample) for s in out.scheduled]


def step(s, token=7):
    out = s.schedule()
    sampled = {x.request_id: token for x in out.scheduled if x.sample}
    return out, s.update_from_output(out, sampled)


def test_chunked_prefill_runs_beside_decodes():
    s = make(budget=8)
    s.add_request(req("a", 3))
    s.add_request(req("b", 20))
    out, _ = step(s)
    assert plan(out) == [("a", 3, 0, True), ("b", 5, 0, False)]
    out, _ = step(s)
    assert plan(out) == [("a", 1, 3, True), ("b", 7, 5, False)]
    out, _ = step(s)
    assert plan(out) == [("a", 1, 4, True), ("b", 7, 12, False)]
    out, _ = step(s)
    assert plan(out) == [("a", 1, 5, True), ("b", 1, 19, True)]
    assert s.requests["b"].num_computed_tokens == 20


def test_without_chunking_a_prompt_waits_for_a_whole_budget():
    s = make(budget=8, chunked=False)
    s.add_request(req("a", 3))
    s.add_request(req("b", 6))
    out, _ = step(s)
    assert plan(out) == [("a", 3, 0, True)]  # b (6) does not fit in the 5 tokens left
    out, _ = step(s)
    assert plan(out) == [("a", 1, 3, True), ("b", 6, 0, True)]


def test_max_num_seqs_and_fcfs():
    s = make(max_seqs=2, budget=64)
    for rid in "abc":
        s.add_request(req(rid, 2))
    out, _ = step(s)
    assert [x.request_id for x in out.scheduled] == ["a", "b"]
    assert [r.request_id for r in s.waiting] == ["c"]


def test_finish_on_length_eos_and_stop_token_frees_blocks():
    s = make(budget=64)
    s.add_request(req("len", 2, max_tokens=2))
    s.add_request(req("eos", 2))
    s.add_request(req("stop", 2, stop_token_ids=[5]))
    out = s.schedule()
    updates = s.update_from_output(out, {"len": 7, "eos": 0, "stop": 5})
    done = {u.request.request_id: u.request for u in updates if u.finished}
    assert done["eos"].get_finish_reason() == "stop" and done["eos"].stop_reason is None
    assert done["stop"].stop_reason == 5
    assert "len" not in done
    out, updates = step(s)
    assert updates[0].finished and updates[0].request.get_finish_reason() == "length"
    assert s.kv.pool.counts() == (16, 0, 0)
    assert sorted(s.schedule().finished_request_ids) == ["len"]


def test_min_tokens_suppresses_eos():
    s = make()
    s.add_request(req("a", 2, min_tokens=2))
    _, updates = step(s, token=0)
    assert not updates[0].finished
    _, updates = step(s, token=0)
    assert updates[0].finished


def test_preemption_newest_first_and_resume_from_zero():
    # 4 blocks of 4 tokens; a and b take 2 blocks each, then both grow and b must give way
    s = make(num_blocks=4, block_size=4, budget=64, caching=False)
    s.add_request(req("a", 8, max_tokens=8))
    s.add_request(req("b", 7, max_tokens=8))
    out, _ = step(s)
    assert s.kv.get_block_ids("a") == [0, 1] and s.kv.get_block_ids("b") == [2, 3]
    out, _ = step(s)  # a needs a 3rd block for token 8: b (newest) is preempted
    assert out.preempted_request_ids == ["b"]
    assert plan(out) == [("a", 1, 8, True)]
    b = s.waiting[0]
    assert b.request_id == "b" and b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.output_token_ids == [7]  # generated tokens are kept and recomputed
    assert s.num_preemptions == 1
    free, cached, in_use = s.kv.pool.counts()
    assert free + cached + in_use == 4


def test_abort_frees_everything_and_is_reported():
    s = make(state_slots=2)
    s.add_request(req("a", 5))
    s.add_request(req("b", 5))
    step(s)
    s.finish_requests(["a", "missing"], RequestStatus.FINISHED_ABORTED)
    assert s.state.num_free_slots == 1 and s.kv.get_block_ids("a") == []
    assert s.schedule().finished_request_ids == ["a"]


def test_state_slots_limit_admission_and_return_on_finish():
    s = make(state_slots=1, budget=64)
    s.add_request(req("a", 2, max_tokens=1))
    s.add_request(req("b", 2, max_tokens=1))
    out, updates = step(s)
    assert plan(out) == [("a", 2, 0, True)] and out.scheduled[0].state_slot == 0
    assert updates[0].finished and s.state.num_free_slots == 1
    out, _ = step(s)
    assert plan(out) == [("b", 2, 0, True)] and out.scheduled[0].state_slot == 0


def test_prefix_hit_starts_counter_above_zero():
    s = make(caching=True, budget=64)
    s.add_request(req("a", 9))
    step(s)
    s.add_request(req("b", 9))
    out, _ = step(s)
    by_id = {x.request_id: x for x in out.scheduled}
    assert (len(by_id["b"].token_ids), by_id["b"].start_pos) == (1, 8)
    assert s.requests["b"].num_cached_tokens == 8


def test_prefix_lookups_count_once_per_admission():
    """The hit-rate metrics count a request's lookup when it is admitted: one held back at the head of the queue
    (no room yet) is looked up again each step without being counted again (was ~35-70x too many queries)."""
    s = make(num_blocks=5, caching=True, budget=64, max_seqs=4)
    s.add_request(req("a", 12, max_tokens=8))  # 3 of the 5 blocks, all 5 with its outputs
    step(s)
    s.add_request(Request("b", list(range(300, 312)), SamplingParams(max_tokens=4), eos_token_ids=frozenset({0}),
                          max_tokens=4))  # 3 blocks, no prefix of a's: waits for a to finish
    for _ in range(3):
        step(s)
        assert s.waiting and s.waiting[0].request_id == "b"
    assert (s.kv.num_queries, s.kv.num_hits) == (12, 0)
    for _ in range(20):
        if not s.waiting:
            break
        step(s)
    assert not s.waiting and (s.kv.num_queries, s.kv.num_hits) == (24, 0)


def test_prefix_lookups_of_preempted_requests_are_counted_apart():
    """vLLM 0.11 keeps the re-lookup of a preempted request (recompute) out of vllm:prefix_cache_queries / _hits: only
    first admissions count there, the re-admissions in the preempted counters."""
    s = make(num_blocks=4, block_size=4, budget=64, caching=True)
    s.add_request(req("a", 8, max_tokens=8))
    s.add_request(Request("b", list(range(300, 307)), SamplingParams(max_tokens=8), eos_token_ids=frozenset({0}),
                          max_tokens=8))  # no prefix of a's
    step(s)
    out, _ = step(s)
    assert out.preempted_request_ids == ["b"]
    while s.has_unfinished_requests():
        step(s)
    assert (s.kv.num_queries, s.kv.num_hits) == (8 + 7, 0)
    # b's prompt and the token it had generated; no hit: a's growth to 4 blocks evicted b's cached block
    assert (s.kv.num_preempted_queries, s.kv.num_preempted_hits) == (7 + 1, 0)
