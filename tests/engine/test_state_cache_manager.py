"""StateCacheManager on plain Python, alone and as the scheduler drives it: exact slot ids."""

from ascendserve.engine.kv_cache_manager import KVCacheManager
from ascendserve.engine.request import Request, RequestStatus
from ascendserve.engine.sampling_params import SamplingParams
from ascendserve.engine.scheduler import Scheduler
from ascendserve.engine.state_cache_manager import StateCacheManager


def _check_invariant(m: StateCacheManager) -> None:
    assert m.num_free_slots + len(m.req_to_slot) == m.num_slots
    assert len(set(m.req_to_slot.values())) == len(m.req_to_slot)


def test_slots_are_handed_out_from_zero_and_run_out():
    m = StateCacheManager(3)
    assert [m.allocate(r) for r in "abc"] == [0, 1, 2]
    assert m.allocate("d") is None and m.get_slot("d") is None
    assert m.num_free_slots == 0
    _check_invariant(m)


def test_allocate_is_idempotent():
    m = StateCacheManager(2)
    assert m.allocate("a") == 0
    assert m.allocate("a") == 0
    assert m.num_free_slots == 1 and m.get_slot("a") == 0


def test_lowest_free_slot_goes_first():
    m = StateCacheManager(4)
    for r in "abc":
        m.allocate(r)
    m.free("b")  # slot 1
    assert m.get_slot("b") is None
    assert m.allocate("d") == 1
    m.free("c")
    m.free("a")
    assert m.allocate("e") == 0  # the lowest, whatever the order of freeing
    assert m.allocate("f") == 2
    assert m.allocate("g") == 3
    assert m.req_to_slot == {"d": 1, "e": 0, "f": 2, "g": 3}
    _check_invariant(m)


def test_free_unknown_or_twice_is_a_no_op():
    m = StateCacheManager(2)
    m.allocate("a")
    m.free("zzz")
    m.free("a")
    m.free("a")
    assert m.num_free_slots == 2
    assert [m.allocate("x"), m.allocate("y")] == [0, 1]
    _check_invariant(m)


# -- driven by the scheduler -------------------------------------------------------------------

def _scheduler(num_slots, num_blocks=16, budget=16, max_seqs=4):
    kv = KVCacheManager(num_blocks, 4, enable_caching=False)
    return Scheduler(kv, max_seqs, budget, max_model_len=64, state_cache_manager=StateCacheManager(num_slots))


def _req(rid, n, max_tokens=3):
    return Request(rid, list(range(100, 100 + n)), SamplingParams(max_tokens=max_tokens),
                   eos_token_ids=frozenset({0}), max_tokens=max_tokens)


def _step(s):
    out = s.schedule()
    s.update_from_output(out, {x.request_id: 7 for x in out.scheduled if x.sample})
    return out


def _slots(out):
    return [(x.request_id, x.state_slot, x.start_pos) for x in out.scheduled]


def test_chunked_prefill_keeps_its_slot():
    s = _scheduler(num_slots=2, budget=6)
    s.add_request(_req("a", 10))
    s.add_request(_req("b", 3))
    assert _slots(_step(s)) == [("a", 0, 0)]  # the budget is spent on a's first chunk
    assert _slots(_step(s)) == [("a", 0, 6), ("b", 1, 0)]  # a continues from slot 0; b gets 2 tokens
    assert _slots(_step(s)) == [("a", 0, 10), ("b", 1, 2)]  # a decodes, b's prefill goes on in slot 1


def test_finish_returns_the_slot_to_the_next_request():
    s = _scheduler(num_slots=1, budget=64)
    s.add_request(_req("a", 2, max_tokens=2))
    s.add_request(_req("b", 2))
    assert _slots(_step(s)) == [("a", 0, 0)]  # b waits: no free slot
    assert _slots(_step(s)) == [("a", 0, 2)]  # a finishes (2 tokens) and frees slot 0
    assert s.state.num_free_slots == 1
    assert _slots(_step(s)) == [("b", 0, 0)]


def test_abort_frees_the_slot():
    s = _scheduler(num_slots=2)
    s.add_request(_req("a", 2))
    s.add_request(_req("b", 2))
    _step(s)
    assert s.state.req_to_slot == {"a": 0, "b": 1}
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert s.state.req_to_slot == {"b": 1}
    s.add_request(_req("c", 2))
    assert ("c", 0, 0) in _slots(_step(s))


def test_preempted_request_restarts_from_zero_in_a_fresh_slot():
    # 4 blocks of 4 tokens: a (8 tokens) and b (8 tokens) fill them; a's next token needs a 5th
    # block, so b (the newest) is preempted, gives back slot 1 and later recomputes from token 0.
    s = _scheduler(num_slots=2, num_blocks=4, budget=64)
    s.add_request(_req("a", 8, max_tokens=2))
    s.add_request(_req("b", 8, max_tokens=2))
    assert _slots(_step(s)) == [("a", 0, 0), ("b", 1, 0)]
    out = _step(s)
    assert out.preempted_request_ids == ["b"] and _slots(out) == [("a", 0, 8)]
    assert s.state.req_to_slot == {} and s.requests["b"].num_computed_tokens == 0  # a finished too
    s.add_request(_req("c", 2))
    out = _step(s)
    assert _slots(out) == [("b", 0, 0), ("c", 1, 0)]  # b: slot 0 (freed last), from token 0
    assert out.scheduled[0].request.num_preemptions == 1
