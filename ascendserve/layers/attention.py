"""Paged attention in plain torch: write new K/V into blocks, attend over each request's blocks.

KV cache of one layer: [2, num_blocks, block_size, num_kv_heads, head_dim]. A token at position p
of a request with block table bt lives at slot bt[p // block_size] * block_size + p % block_size.
The cache is in the model dtype, or narrower (--kv-cache-dtype bfloat16 under an fp32 model): K/V are
rounded as they are stored and widened back to the query dtype where they are read.
"""

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ascendserve.layers import cpu_kernels, triton_kernels


@dataclass
class PrefillSeq:
    """One request with more than one new token this step, or `count` > 1 requests back to back with
    no cached prefix and the same number of new tokens: one SDPA call (a batch) for all of them."""

    token_start: int  # its rows in the packed batch: [token_start, token_end)
    token_end: int
    kv_slots: torch.Tensor | None  # [context_len] slots of all its tokens; None if no cached prefix
    mask: torch.Tensor | None  # [q_len, context_len] bool, True = may attend; None = plain causal
    count: int = 1


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step, built once by the runner and shared by all layers."""

    slot_mapping: torch.Tensor  # [T] cache slot of every new token
    decode_token_idx: torch.Tensor | None  # [Bd] rows of the single-token requests
    decode_block_tables: torch.Tensor | None  # [Bd, max_blocks] their block tables (padded with block 0)
    decode_context_lens: torch.Tensor | None  # [Bd] int64 tokens each decode attends to (its new one included)
    prefills: list[PrefillSeq]
    # The gathered decode's length mask [Bd, 1, 1, max_blocks * block_size] (False past the context): made by the
    # first layer that gathers (the kernels that read blocks in place need none), inside the forward, so a captured
    # decode graph records it; reused by the other layers.
    decode_mask: torch.Tensor | None = None
    # Scratch for the decode block gather [2, Bd * max_blocks, block_size, Hk, D]: allocated by the
    # first attention layer of the step, reused by the others. A fresh buffer per layer (10-100 MB at
    # batch 64) spent more time faulting in new pages than copying (benchmarks/probe_decode_attention.py).
    decode_kv_workspace: torch.Tensor | None = None


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store k, v [T, Hk, D] at their slots (in the cache's dtype). On the CPU one kernel copies the rows on every
    thread (the demo's 8 x 256 bf16 prefill: the 60 index_copy_ calls of a step took ~9 ms)."""
    if (kv_cache.device.type == "cpu" and k.dtype == v.dtype and _kernel_reads(k.dtype, kv_cache.dtype)
            and _rows_contiguous(k) and _rows_contiguous(v) and (kernels := cpu_kernels.ops()) is not None):
        kernels.paged_kv_write(k, v, kv_cache, slot_mapping)
        return
    k_flat = kv_cache[0].view(-1, *k.shape[1:])
    v_flat = kv_cache[1].view(-1, *v.shape[1:])
    k_flat.index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    v_flat.index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


_HALVES = (torch.bfloat16, torch.float16)


def _kernel_reads(q_dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """Whether the CPU decode kernel takes these dtypes: one for both, or fp32 queries over a bf16 / fp16 cache."""
    if q_dtype == cache_dtype:
        return q_dtype == torch.float32 or q_dtype in _HALVES
    return q_dtype == torch.float32 and cache_dtype in _HALVES


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Causal attention of the new tokens q/k/v [T, H, D] over their cached context -> [T, Hq, D].

    Every layer writes all new K/V first, so requests in the same step can read blocks that
    another request fills in this very step (shared prefix blocks).
    """
    if meta.decode_token_idx is not None and not meta.prefills:  # a pure decode step: every row, in order
        if (q.device.type == "cpu" and q.dtype == k.dtype == v.dtype and _kernel_reads(q.dtype, kv_cache.dtype)
                and _rows_contiguous(k) and _rows_contiguous(v)
                and (kernels := cpu_kernels.ops()) is not None):  # it stores k / v too
            # Its SIMD loops take fp32 queries (over any cache dtype), and bf16 ones over a bf16 cache where the CPU
            # has AVX512-BF16: a bf16 / fp16 model's queries are otherwise widened (exact) and the output rounded
            # once. 2-core Xeon, the demo in bf16, 64 streams of ~140 tokens: the 30 layers' attention 25.7 -> 22.6 ms
            # a step widened (torch.profiler, 5 steps, one process each).
            wide = _widen_queries(q, kv_cache, kernels)
            out = kernels.paged_decode_write(q.float().contiguous() if wide else q.contiguous(), k, v, kv_cache,
                                             meta.slot_mapping, meta.decode_block_tables, meta.decode_context_lens,
                                             scale)
            return out.to(q.dtype) if wide else out
        write_kv(kv_cache, k, v, meta.slot_mapping)
        return _decode(q.contiguous(), kv_cache, meta, scale)
    write_kv(kv_cache, k, v, meta.slot_mapping)
    out = torch.empty_like(q)
    k_flat = kv_cache[0].view(-1, *k.shape[1:])
    v_flat = kv_cache[1].view(-1, *v.shape[1:])
    if meta.decode_token_idx is not None:
        out[meta.decode_token_idx] = _decode(q[meta.decode_token_idx], kv_cache, meta, scale)
    for seq in meta.prefills:
        rows = slice(seq.token_start, seq.token_end)
        if seq.kv_slots is None:  # fresh prompts: their own new k/v, `count` of them as a batch
            qs, ks, vs = q[rows], k[rows], v[rows]
        else:  # a cached prefix: the keys of the whole context, from the cache
            qs, ks, vs = q[rows], k_flat[seq.kv_slots].to(q.dtype), v_flat[seq.kv_slots].to(q.dtype)
        if _prefill_kernel_takes(out, qs, ks, vs):
            cpu_kernels.ops().prefill_attention(out[rows], qs, ks, vs, seq.count, scale)
            continue
        qs, ks, vs = (x.unflatten(0, (seq.count, -1)) for x in (qs, ks, vs))
        out[rows] = _sdpa(qs, ks, vs, seq.mask, scale).flatten(0, 1)
    return out


def _prefill_kernel_takes(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the CPU prefill attention kernel (csrc/prefill_attention_cpu.cpp) runs these [T, H, D] tensors:
    fp32, or bf16 (a model run in bf16: the kernel widens each value as it packs it, exact, and rounds its fp32 result
    once), all four of one dtype on CPU, head_dim a multiple of 16, each row's heads contiguous, the kernels built.
    Its causal mask is the one _prefill_seq builds (query i of a chunk after a prefix of P tokens sees keys 0 .. P + i).

    bf16 stays on this exact fp32 arithmetic rather than SDPA's bf16 path, which is faster with AMX (2-core Xeon, 8
    causal sequences of 256, ms per layer, SDPA bf16 / this kernel: the demo's heads 2.7 / 6.5, Qwen3.5's 4.9 / 17.5)
    but rounds more: the demo's greedy answer to "What is the capital of France?" lost "Paris"
    (tests/entrypoints/test_llm.py). 2-core AMD EPYC (Zen 4), the demo's 8 x 256 prefill in bf16: SDPA's bf16 path took
    18% of the step (546 ms of its 30 layers' 3 s, torch.profiler). With head_dim a multiple of 32 the kernel multiplies
    bf16 values on AMX or on vdpbf16ps (AVX512-BF16) with P split into two bf16 parts, to within the output's rounding
    of the fp32 loops."""
    return (q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16)
            and out.dtype == q.dtype == k.dtype == v.dtype and q.shape[-1] % 16 == 0
            and all(_rows_contiguous(t) for t in (out, q, k, v)) and cpu_kernels.ops() is not None)


_bf16_dot_by_head_dim: dict[int, bool] = {}  # kernels.paged_decode_bf16_dot(head_dim), asked once per head_dim


def _widen_queries(q: torch.Tensor, kv_cache: torch.Tensor, kernels) -> bool:
    """Whether the decode kernel gets q widened to fp32: half-precision queries, unless bf16 ones over a bf16 cache
    whose head_dim the kernel multiplies with vdpbf16ps (exact products, fp32 sums: the same arithmetic as the widened
    queries, summed in another order; the kernel says which head_dims, per process)."""
    if q.dtype not in _HALVES:
        return False
    if not q.dtype == kv_cache.dtype == torch.bfloat16:
        return True
    head_dim = q.shape[-1]
    if head_dim not in _bf16_dot_by_head_dim:
        _bf16_dot_by_head_dim[head_dim] = kernels.paged_decode_bf16_dot(head_dim)
    return not _bf16_dot_by_head_dim[head_dim]


def _rows_contiguous(t: torch.Tensor) -> bool:
    """Each row of t [T, H, D] contiguous (the views the qkv split gives; the row stride is free)."""
    return t.stride(2) == 1 and t.stride(1) == t.shape[2]


def _decode(q, kv_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q [Bd, Hq, D], one token per request, over its cached blocks -> [Bd, Hq, D].

    The G = Hq / Hk query heads that share kv head j (heads j*G .. j*G+G-1, enable_gqa's grouping)
    go to SDPA as G query rows of head j, q [Bd, Hk, G, D]: each kv head's K/V is read once for its
    G queries, a [G, D] x [D, T] product, not once per query head. No causal mask: the
    new token sees its whole context; the length mask hides the padding of shorter requests.
    On CPU the C++ kernel (cpu_kernels) does the same reading K/V in place, without the gather; on a GPU so does
    the Triton kernel when ASCENDSERVE_TRITON_KERNELS=1 (layers/triton_kernels.py).
    """
    if (q.device.type == "cpu" and _kernel_reads(q.dtype, kv_cache.dtype)
            and (kernels := cpu_kernels.ops()) is not None):  # fp32 queries, as paged_attention's decode-only steps
        out = kernels.paged_decode(q.float() if _widen_queries(q, kv_cache, kernels) else q, kv_cache,
                                   meta.decode_block_tables, meta.decode_context_lens, scale)
        return out.to(q.dtype)
    if ((kernels := triton_kernels.ops_for(q)) is not None
            and kernels.supports_paged_decode(kv_cache.shape[2], kv_cache.shape[-1])):
        return kernels.paged_decode(q, kv_cache, meta.decode_block_tables, meta.decode_context_lens, scale)
    num_decodes, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[-2]
    kv = _gather_decode_blocks(kv_cache, meta).to(q.dtype)  # [2, Bd, T, Hk, D]
    if meta.decode_mask is None:
        span = torch.arange(kv.shape[2], device=q.device)
        meta.decode_mask = (span[None, :] < meta.decode_context_lens[:, None])[:, None, None, :]
    out = F.scaled_dot_product_attention(q.reshape(num_decodes, num_kv_heads, -1, head_dim),
                                         kv[0].transpose(1, 2), kv[1].transpose(1, 2),
                                         attn_mask=meta.decode_mask, scale=scale)
    return out.reshape(num_decodes, num_heads, head_dim)


def _gather_decode_blocks(kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """K and V of the decode requests' blocks, [2, Bd, max_blocks * block_size, Hk, D], in the step's workspace."""
    tables = meta.decode_block_tables
    shape = (2, tables.numel(), *kv_cache.shape[2:])
    workspace = meta.decode_kv_workspace
    if workspace is None or workspace.shape != shape or workspace.dtype != kv_cache.dtype:
        workspace = meta.decode_kv_workspace = kv_cache.new_empty(shape)
    torch.index_select(kv_cache, 1, tables.view(-1), out=workspace)
    return workspace.view(2, tables.shape[0], -1, *kv_cache.shape[-2:])


def _sdpa(q, k, v, mask, scale, causal=True) -> torch.Tensor:
    """q [B, Tq, Hq, D], k/v [B, Tk, Hk, D] -> [B, Tq, Hq, D]."""
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if mask is not None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                             enable_gqa=q.shape[1] != k.shape[1])
    else:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                             enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2)


def build_attention_metadata(query_lens: np.ndarray, start_positions: np.ndarray, positions: np.ndarray,
                             block_tables: list[list[int]], block_size: int,
                             device: torch.device) -> AttentionMetadata:
    """Turn per-request (new tokens, start position, block table) into slots, gathers and masks.

    `positions` are the packed positions of every new token. Example, block_size 4: a request with
    block table [7, 2] computing positions 4..5 writes slots [8, 9] (block 2, offsets 0 and 1).
    """
    num_reqs = len(query_lens)
    max_blocks = max(len(t) for t in block_tables)
    tables = np.zeros((num_reqs, max_blocks), dtype=np.int64)
    for i, table in enumerate(block_tables):
        tables[i, :len(table)] = table
    req_of_token = np.repeat(np.arange(num_reqs), query_lens)
    slots = tables[req_of_token, positions // block_size] * block_size + positions % block_size
    meta = AttentionMetadata(torch.from_numpy(slots).to(device), None, None, None, [])
    context_lens = start_positions + query_lens
    is_decode = query_lens == 1
    if is_decode.any():
        rows = (np.cumsum(query_lens) - query_lens)[is_decode]
        decode_tables = tables[is_decode, :int(-(-context_lens[is_decode].max() // block_size))]
        meta.decode_token_idx = torch.from_numpy(rows).to(device)
        meta.decode_block_tables = torch.from_numpy(np.ascontiguousarray(decode_tables)).to(device)
        meta.decode_context_lens = torch.from_numpy(context_lens[is_decode]).to(device)
    row = 0
    for i in range(num_reqs):
        q_len, start = int(query_lens[i]), int(start_positions[i])
        if q_len > 1:
            last = meta.prefills[-1] if meta.prefills else None
            if (start == 0 and last is not None and last.kv_slots is None and last.token_end == row
                    and last.token_end - last.token_start == q_len * last.count):
                last.token_end, last.count = row + q_len, last.count + 1  # one more fresh prompt of its length
            else:
                meta.prefills.append(_prefill_seq(row, q_len, start, tables[i], block_size, device))
        row += q_len
    return meta


def _prefill_seq(row: int, q_len: int, start: int, table: np.ndarray, block_size: int, device) -> PrefillSeq:
    if start == 0:
        return PrefillSeq(row, row + q_len, None, None)
    ctx = start + q_len
    span = np.arange(ctx)
    kv_slots = table[span // block_size] * block_size + span % block_size
    q_pos = torch.arange(start, ctx, device=device)[:, None]
    mask = torch.arange(ctx, device=device)[None, :] <= q_pos
    return PrefillSeq(row, row + q_len, torch.from_numpy(kv_slots).to(device), mask)
