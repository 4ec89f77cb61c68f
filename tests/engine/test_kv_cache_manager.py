"""KV cache manager and block pool on plain Python: exact block ids, sharing and eviction order."""

from ascendserve.engine.block_pool import BlockPool, hash_block_tokens
from ascendserve.engine.kv_cache_manager import KVCacheManager
from ascendserve.engine.request import Request
from ascendserve.engine.sampling_params import SamplingParams


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4))


def check_invariant(pool: BlockPool) -> None:
    free, cached, in_use = pool.counts()
    assert free + cached + in_use == pool.num_blocks


def test_hash_is_chained_and_process_independent():
    a = hash_block_tokens(None, [1, 2, 3, 4])
    assert a == hash_block_tokens(None, [1, 2, 3, 4])
    assert a != hash_block_tokens(None, [1, 2, 3, 5])
    assert hash_block_tokens(a, [5, 6, 7, 8]) != hash_block_tokens(None, [5, 6, 7, 8])
    # a fixed value: the hash must not depend on PYTHONHASHSEED or the process
    assert a.hex() == hash_block_tokens(None, (1, 2, 3, 4)).hex() and len(a) == 16


def test_allocation_takes_lowest_free_ids_and_grows():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False)
    r = req("a", list(range(10)))
    assert kv.allocate_slots(r, 10)
    assert kv.get_block_ids("a") == [0, 1, 2]
    r.num_computed_tokens = 10
    assert kv.allocate_slots(r, 2)  # 12 tokens still fit in 3 blocks
    assert kv.get_block_ids("a") == [0, 1, 2]
    r.num_computed_tokens = 12
    assert kv.allocate_slots(r, 1)
    assert kv.get_block_ids("a") == [0, 1, 2, 3]
    check_invariant(kv.pool)


def test_allocation_fails_without_side_effects():
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_caching=False)
    a, b = req("a", list(range(12))), req("b", list(range(8)))
    assert kv.allocate_slots(a, 12)
    assert not kv.allocate_slots(b, 8)
    assert kv.get_block_ids("b") == [] and kv.pool.num_free_blocks == 1
    check_invariant(kv.pool)


def test_prefix_hit_shares_blocks_and_never_covers_last_token():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_caching=True)
    a = req("a", list(range(10)))
    hits, n = kv.get_computed_blocks(a)
    assert (hits, n) == ([], 0)
    assert kv.allocate_slots(a, 10)
    assert kv.get_block_ids("a") == [0, 1, 2]
    b = req("b", list(range(8)) + [99, 98, 97])
    hits, n = kv.get_computed_blocks(b)
    assert [h.block_id for h in hits] == [0, 1] and n == 8
    assert kv.allocate_slots(b, 3, hits)
    assert kv.get_block_ids("b") == [0, 1, 3]
    assert kv.pool.blocks[0].ref_cnt == 2
    # exactly two full blocks: the last token must be recomputed, so only one block hits
    c = req("c", list(range(8)))
    hits, n = kv.get_computed_blocks(c)
    assert [h.block_id for h in hits] == [0] and n == 4
    check_invariant(kv.pool)


def test_eviction_is_lru_with_tail_blocks_first():
    kv = KVCacheManager(num_blocks=6, block_size=2, enable_caching=True)
    a = req("a", [1, 2, 3, 4, 5, 6, 7])  # blocks 0,1,2 full (cached), block 3 partial
    assert kv.allocate_slots(a, 7)
    kv.free(a)
    free, cached, in_use = kv.pool.counts()
    assert (free, cached, in_use) == (3, 3, 0)
    # 3 never-used/uncached blocks are handed out first: 4, 5 and then 3 (freed, uncached)
    b = req("b", [9] * 6)
    assert kv.allocate_slots(b, 6)
    assert kv.get_block_ids("b") == [4, 5, 3]
    # next allocations evict cached blocks tail-first: 2, then 1, then 0
    c = req("c", [8] * 2)
    assert kv.allocate_slots(c, 2)
    assert kv.get_block_ids("c") == [2]
    # block 2 was evicted: a's first two blocks still hit, the third does not
    a2 = req("a2", [1, 2, 3, 4, 5, 6, 7])
    hits, n = kv.get_computed_blocks(a2)
    assert [h.block_id for h in hits] == [0, 1] and n == 4
    check_invariant(kv.pool)


def test_hit_on_evictable_block_counts_against_free_space():
    kv = KVCacheManager(num_blocks=3, block_size=2, enable_caching=True)
    a = req("a", [1, 2, 3, 4, 5])
    assert kv.allocate_slots(a, 5)
    kv.free(a)  # blocks 0, 1 cached; block 2 free
    b = req("b", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    hits, n = kv.get_computed_blocks(b)
    assert n == 4
    # needs 5 blocks in total: 2 hits + 3 new, but only 1 block is not a hit
    assert not kv.allocate_slots(b, 5, hits)
    assert kv.pool.counts() == (1, 2, 0)
    c = req("c", [1, 2, 3, 4, 5, 6])
    hits, n = kv.get_computed_blocks(c)
    assert kv.allocate_slots(c, 2, hits)
    assert kv.get_block_ids("c") == [0, 1, 2]
    check_invariant(kv.pool)


def test_hash_collision_is_caught_by_token_check():
    pool = BlockPool(2, enable_caching=True)
    block = pool.allocate(1)[0]
    pool.cache_block(block, b"h" * 16, [1, 2])
    assert pool.get_cached_block(b"h" * 16, [1, 2]) is block
    assert pool.get_cached_block(b"h" * 16, [1, 3]) is None


def test_reset_prefix_cache():
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_caching=True)
    a = req("a", [1, 2, 3, 4, 5])
    assert kv.allocate_slots(a, 5)
    assert not kv.reset_prefix_cache()
    kv.free(a)
    assert kv.reset_prefix_cache()
    assert kv.pool.counts() == (4, 0, 0)
    assert kv.get_computed_blocks(req("b", [1, 2, 3, 4, 5])) == ([], 0)
