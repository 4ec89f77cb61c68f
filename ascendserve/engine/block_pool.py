"""The pool of KV cache blocks: reference counts, the prefix-cache index and LRU eviction.

Every block is in exactly one of three states, so `num_free + num_cached + num_in_use == num_blocks`
holds after every operation:
  - free:   ref_cnt == 0 and no hash (never filled, or evicted)
  - cached: ref_cnt == 0 with a hash; reusable by a prefix hit, evictable least-recently-used first
  - in use: ref_cnt > 0 (it may also carry a hash, and then other requests can share it)
"""

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

NONE_HASH = b"\x00" * 16


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int]) -> bytes:
    """Chained, process-independent hash of one full block: blake2b(parent || tokens)."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(parent_hash or NONE_HASH)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


class KVCacheBlock:
    """One block of `block_size` token slots in every attention layer's cache."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.token_ids: tuple[int, ...] | None = None  # kept to check a hit token by token

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class BlockPool:
    """Owns all blocks; hands them out, takes them back and indexes the full ones by hash."""

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # Never-cached free blocks are handed out first (lowest id first), then cached ones are
        # evicted in LRU order: the OrderedDict's first item is the least recently freed.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[bytes, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free plus evictable cached)."""
        return len(self._free) + len(self._evictable)

    def counts(self) -> tuple[int, int, int]:
        """(free, cached-and-unused, in use) — they always add up to num_blocks."""
        in_use = sum(1 for b in self.blocks if b.ref_cnt > 0)
        return len(self._free), len(self._evictable), in_use

    def usage(self) -> float:
        """Fraction of blocks held by running requests."""
        return 1.0 - self.num_free_blocks / self.num_blocks if self.num_blocks else 0.0

    def get_cached_block(self, block_hash: bytes, token_ids: Sequence[int]) -> KVCacheBlock | None:
        """The block cached under this hash, if its tokens really are `token_ids`."""
        block = self._cached.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None
        return block

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Take a reference on prefix-hit blocks, pulling unused ones out of the eviction queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._evictable[block.block_id]
            block.ref_cnt += 1

    def allocate(self, num: int) -> list[KVCacheBlock]:
        """Hand out `num` blocks with ref_cnt 1; the caller checked `num_free_blocks` first."""
        if num > self.num_free_blocks:
            raise RuntimeError(f"cannot allocate {num} KV blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(num):
            if self._free:
                block = self.blocks[self._free.popitem(last=False)[0]]
            else:
                block = self.blocks[self._evictable.popitem(last=False)[0]]
                self._uncache(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def free(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Drop one reference from each block, in the given order (it becomes the eviction order)."""
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, block
            if block.ref_cnt == 0:
                queue = self._evictable if block.block_hash is not None else self._free
                queue[block.block_id] = None

    def cache_block(self, block: KVCacheBlock, block_hash: bytes, token_ids: Sequence[int]) -> None:
        """Index a full, in-use block by hash so later requests can share it."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:  # an identical block is already indexed; keep the first
            return
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self._cached[block_hash] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block that no request holds; False if some are still in use."""
        if any(b.ref_cnt > 0 for b in self.blocks):
            return False
        for block_id in list(self._evictable):
            self._uncache(self.blocks[block_id])
            self._free[block_id] = None
        self._evictable.clear()
        return True

    def _uncache(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None and self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
        block.block_hash = None
        block.token_ids = None
