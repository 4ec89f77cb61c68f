"""Block tables per request on top of the BlockPool, with prefix caching by chained block hashes."""

from ascendserve.engine.block_pool import BlockPool, KVCacheBlock, hash_block_tokens
from ascendserve.engine.request import Request


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(-a // b)


class KVCacheManager:
    """Gives each request the blocks its tokens need and shares full blocks between requests.

    A block becomes shareable ("cached") as soon as the tokens that fill it are scheduled: the runner
    writes every layer's new KV before any attention in that layer reads, so a request admitted in
    the same step may already hit it (this is how the `n` samples of one prompt share its blocks).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # leading blocks of each request already indexed
        # Prefix-cache lookups of first admissions (vllm:prefix_cache_queries / _hits): requests, tokens looked up,
        # tokens found
        self.num_queried_requests = 0
        self.num_queries = 0
        self.num_hits = 0
        # Re-admissions of preempted requests (recompute), counted apart as vLLM 0.11 does
        self.num_preempted_queries = 0
        self.num_preempted_hits = 0

    @property
    def num_blocks(self) -> int:
        """Total blocks in the pool."""
        return self.pool.num_blocks

    def usage(self) -> float:
        """Fraction of the KV pool held by requests (vllm:kv_cache_usage_perc)."""
        return self.pool.usage()

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of `request` as (blocks, number of tokens), never its last token.

        The last token is always recomputed because its logits are needed to sample: with
        block_size 4, a 9-token prompt can hit at most 2 blocks (8 tokens), an 8-token one only 1.
        A request still computing prompt logprobs gets no hit (it needs every prompt position's logits), nor one that
        asks not to read the cache.
        """
        if not self.enable_caching or request.skips_prefix_cache:
            return [], 0
        self._update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for i, block_hash in enumerate(request.block_hashes[:max_blocks]):
            tokens = request.all_token_ids[i * self.block_size:(i + 1) * self.block_size]
            block = self.pool.get_cached_block(block_hash, tokens)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_lookup(self, request: Request, num_hit_tokens: int) -> None:
        """Count a prefix lookup in the hit-rate metrics, once the request it was for is admitted (a request held
        back at the head of the queue is looked up again each step, and counted once). A preempted request's
        lookup on re-admission goes to the preempted counters: its own blocks, freed moments ago, would read as
        hits and inflate the rate."""
        if not self.enable_caching:
            return
        if request.num_preemptions:
            self.num_preempted_queries += request.num_tokens
            self.num_preempted_hits += num_hit_tokens
        else:
            self.num_queried_requests += 1
            self.num_queries += request.num_tokens
            self.num_hits += num_hit_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] | None = None) -> bool:
        """Make room for `num_new_tokens` more tokens of `request`; False (and no change) if full.

        `new_computed_blocks` are prefix hits from `get_computed_blocks`, taken only on success.
        """
        computed = new_computed_blocks or []
        blocks = self.req_to_blocks.get(request.request_id, [])
        num_computed = request.num_computed_tokens + len(computed) * self.block_size
        num_needed = cdiv(num_computed + num_new_tokens, self.block_size) - len(blocks) - len(computed)
        num_evictable_hits = sum(1 for b in computed if b.ref_cnt == 0)
        if max(num_needed, 0) > self.pool.num_free_blocks - num_evictable_hits:
            return False
        self.pool.touch(computed)
        blocks = self.req_to_blocks.setdefault(request.request_id, blocks)
        blocks.extend(computed)
        if num_needed > 0:
            blocks.extend(self.pool.allocate(num_needed))
        self._cache_full_blocks(request, num_computed + num_new_tokens)
        return True

    def free(self, request: Request) -> None:
        """Return all blocks of `request`; its tail blocks become the first to be evicted."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.pool.free(list(reversed(blocks)))

    def get_block_ids(self, request_id: str) -> list[int]:
        """The block table of one request."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return cdiv(num_tokens, self.block_size)

    def reset_prefix_cache(self) -> bool:
        """Drop every unused cached block (False if requests still hold blocks)."""
        return self.pool.reset_prefix_cache()

    def _update_block_hashes(self, request: Request) -> None:
        """Extend request.block_hashes to cover every full block of its known tokens."""
        bs = self.block_size
        hashes = request.block_hashes
        for i in range(len(hashes), request.num_tokens // bs):
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block_tokens(parent, request.all_token_ids[i * bs:(i + 1) * bs]))

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        if not self.enable_caching:
            return
        self._update_block_hashes(request)
        blocks = self.req_to_blocks[request.request_id]
        bs = self.block_size
        start = self.num_cached_blocks.get(request.request_id, 0)
        end = min(num_tokens // bs, len(request.block_hashes))
        for i in range(start, end):
            tokens = request.all_token_ids[i * bs:(i + 1) * bs]
            self.pool.cache_block(blocks[i], request.block_hashes[i], tokens)
        self.num_cached_blocks[request.request_id] = max(start, end)
