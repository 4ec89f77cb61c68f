"""Paged decode attention against dense SDPA: the C++ CPU kernel, and the plain-torch path (query heads
grouped per kv head, shared gather workspace) that other devices and ASCENDSERVE_CPU_KERNELS=0 use."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ascendserve.layers import attention, cpu_kernels
from ascendserve.layers.attention import build_attention_metadata, paged_attention

BLOCK_SIZE = 4


@pytest.fixture(params=["kernel", "torch"])
def decode_path(request, monkeypatch):
    """Run the test once through the C++ kernel (which must build here) and once through plain torch."""
    if request.param == "kernel":
        assert cpu_kernels.ops() is not None, "the CPU kernels did not build: see the warning above"
    else:
        monkeypatch.setitem(cpu_kernels._state, "ops", None)
    return request.param


def _dense_reference(q, ks, vs, scale):
    """q [Hq, D] of one new token over its whole context ks/vs [T, Hk, D] -> [Hq, D]."""
    out = F.scaled_dot_product_attention(q[None, :, None], ks.transpose(0, 1)[None], vs.transpose(0, 1)[None],
                                         scale=scale, enable_gqa=True)
    return out[0, :, 0]


def _step(context_lens, num_heads, num_kv_heads, head_dim, seed, block_size=BLOCK_SIZE):
    """A decode step of len(context_lens) requests on shuffled blocks; returns (q, k, v, cache, meta, histories)."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in context_lens) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, histories = [], []
    cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim)
    for n in context_lens:
        table = [order.pop() for _ in range(-(-n // block_size))]
        tables.append(table)
        past = torch.randn(2, n - 1, num_kv_heads, head_dim, generator=gen)
        for p in range(n - 1):  # the cached context, written where the block table says
            cache[:, table[p // block_size], p % block_size] = past[:, p]
        histories.append(past)
    lens = np.array(context_lens)
    meta = build_attention_metadata(np.ones(len(lens), dtype=np.int64), lens - 1, lens - 1, tables, block_size,
                                    torch.device("cpu"))
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen)
    k = torch.randn(len(lens), num_kv_heads, head_dim, generator=gen)
    v = torch.randn(len(lens), num_kv_heads, head_dim, generator=gen)
    return q, k, v, cache, meta, histories


# SmolLM2's heads, Qwen3.5's (head_dim 256), and head_dims not a multiple of 16 (AVX-512's width; 24 and 8
# still take the AVX2 loops).
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(9, 3, 64), (8, 2, 32), (4, 4, 16), (8, 2, 256),
                                                               (4, 2, 24), (2, 1, 8)])
def test_decode_matches_dense_attention_over_the_context(num_heads, num_kv_heads, head_dim, decode_path):
    context_lens = [1, 5, 8, 13, 30]  # block edges and a one-token context; tables padded to the longest
    q, k, v, cache, meta, histories = _step(context_lens, num_heads, num_kv_heads, head_dim, seed=0)
    out = paged_attention(q, k, v, cache, meta, head_dim ** -0.5)
    for i, past in enumerate(histories):
        ks, vs = torch.cat([past[0], k[i:i + 1]]), torch.cat([past[1], v[i:i + 1]])
        ref = _dense_reference(q[i], ks, vs, head_dim ** -0.5)
        torch.testing.assert_close(out[i], ref, rtol=1e-5, atol=1e-5)


def test_decode_softmax_over_long_contexts_and_large_scores(decode_path):
    # Scores far apart (q scaled up) and contexts past one 16-lane chunk with a ragged tail: the kernel's
    # polynomial exp and its masked loads, against SDPA.
    q, k, v, cache, meta, histories = _step([1, 17, 64, 301], 9, 3, 64, seed=3)
    q = q * 6
    out = paged_attention(q, k, v, cache, meta, 64 ** -0.5)
    for i, past in enumerate(histories):
        ks, vs = torch.cat([past[0], k[i:i + 1]]), torch.cat([past[1], v[i:i + 1]])
        torch.testing.assert_close(out[i], _dense_reference(q[i], ks, vs, 64 ** -0.5), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_in_half_precision_matches_fp32_attention(dtype, decode_path):
    q, k, v, cache, meta, histories = _step([3, 17, 40], 8, 2, 32, seed=2)
    q, k, v, cache = q.to(dtype), k.to(dtype), v.to(dtype), cache.to(dtype)
    out = paged_attention(q, k, v, cache, meta, 32 ** -0.5)
    assert out.dtype == dtype
    for i, past in enumerate(histories):
        ks = torch.cat([past[0].to(dtype), k[i:i + 1]]).float()
        vs = torch.cat([past[1].to(dtype), v[i:i + 1]]).float()
        ref = _dense_reference(q[i].float(), ks, vs, 32 ** -0.5)
        torch.testing.assert_close(out[i].float(), ref, rtol=2e-2, atol=2e-2)


# A model run in bf16 over its bf16 cache: where the CPU has AVX512-BF16 the kernel takes the bf16 queries as they are
# (vdpbf16ps over each key: exact products, fp32 sums; 16 keys' sums reduced together), the softmax and P V in fp32,
# the output rounded once, so it is fp32 attention over the bf16 values within one bf16 rounding. Group sizes past
# the V pass's four rows at a time, head_dims of 1, 2, 4 and 8 registers (and 48, which widens), blocks of 4, 16 and
# 32 keys (16-key runs and ragged tails). The plain-torch path (SDPA in bf16) to the looser tolerance of the test above.
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(9, 3, 64), (8, 2, 256), (16, 2, 128), (6, 6, 32),
                                                               (5, 1, 48)])
@pytest.mark.parametrize("block_size", [4, 16, 32])
def test_bf16_decode_over_a_bf16_cache_is_fp32_attention_rounded_once(num_heads, num_kv_heads, head_dim,
                                                                      block_size, decode_path):
    q, k, v, cache, meta, histories = _step([1, 16, 17, 45, 70], num_heads, num_kv_heads, head_dim, seed=11,
                                            block_size=block_size)
    q, k, v, cache = (t.bfloat16() for t in (q * 3, k, v, cache))  # q scaled up: peaked softmaxes too
    out = paged_attention(q, k, v, cache, meta, head_dim ** -0.5)
    assert out.dtype == torch.bfloat16
    for i, past in enumerate(histories):
        ks, vs = (torch.cat([past[j].bfloat16(), new[i:i + 1]]).float() for j, new in ((0, k), (1, v)))
        ref = _dense_reference(q[i].float(), ks, vs, head_dim ** -0.5)
        if decode_path == "kernel":
            torch.testing.assert_close(out[i].float(), ref, rtol=2 ** -8, atol=1e-4)
        else:  # SDPA's bf16 path rounds its intermediates
            torch.testing.assert_close(out[i].float(), ref, rtol=2e-2, atol=2e-2)


def test_the_decode_kernel_takes_bf16_queries_where_the_cpu_has_avx512_bf16(kernels):
    from ascendserve.platforms.cpu import cpu_flags
    has = "avx512_bf16" in cpu_flags()
    assert [kernels.paged_decode_bf16_dot(d) for d in (32, 64, 256, 48, 288)] == [has, has, has, False, False]


# --kv-cache-dtype bfloat16 / float16 under an fp32 model: fp32 queries and new k / v, a half-precision
# cache. The new k / v are rounded as they are stored (by the kernel or by write_kv); attention is fp32
# over the rounded values, so it matches dense fp32 attention over them closely. head_dim 16, 64, 256 take
# the AVX2 loops (bf16: 16 values a load, split into even and odd ones), 24 and 4 the portable ones.
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(9, 3, 64), (8, 2, 256), (4, 2, 16), (4, 2, 24),
                                                               (2, 1, 4)])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
def test_decode_over_a_half_precision_cache_under_fp32_queries(num_heads, num_kv_heads, head_dim, cache_dtype,
                                                               decode_path):
    q, k, v, cache, meta, histories = _step([1, 5, 13, 40], num_heads, num_kv_heads, head_dim, seed=7)
    cache = cache.to(cache_dtype)
    out = paged_attention(q, k, v, cache, meta, head_dim ** -0.5)
    assert out.dtype == torch.float32
    flat = cache.view(2, -1, num_kv_heads, head_dim)
    assert torch.equal(flat[0, meta.slot_mapping], k.to(cache_dtype))  # rounded to nearest even, as torch does
    assert torch.equal(flat[1, meta.slot_mapping], v.to(cache_dtype))
    for i, past in enumerate(histories):
        ks, vs = (torch.cat([past[j], new[i:i + 1]]).to(cache_dtype).float() for j, new in ((0, k), (1, v)))
        ref = _dense_reference(q[i], ks, vs, head_dim ** -0.5)
        torch.testing.assert_close(out[i], ref, rtol=1e-5, atol=1e-5)


def test_kernel_refuses_a_cache_dtype_it_does_not_read_and_attention_falls_back(kernels):
    # bf16 queries over an fp16 cache: not a pair the kernel takes; paged_attention gathers and converts.
    q, k, v, cache, meta, histories = _step([3, 9], 4, 2, 16, seed=8)
    q, k, v, cache = q.bfloat16(), k.bfloat16(), v.bfloat16(), cache.half()
    with pytest.raises(RuntimeError, match="Half cache under BFloat16 queries is not supported"):
        kernels.paged_decode(q, cache, meta.decode_block_tables, meta.decode_context_lens, 0.25)
    with pytest.raises(RuntimeError, match="BFloat16 k / v into a Half cache is not supported"):
        kernels.paged_decode_write(q.float(), k, v, cache, meta.slot_mapping, meta.decode_block_tables,
                                   meta.decode_context_lens, 0.25)
    before = cache.clone()  # k / v of the cache's dtype, but the queries' pair refused: nothing is stored
    with pytest.raises(RuntimeError, match="Half cache under BFloat16 queries is not supported"):
        kernels.paged_decode_write(q, k.half(), v.half(), cache, meta.slot_mapping, meta.decode_block_tables,
                                   meta.decode_context_lens, 0.25)
    assert torch.equal(cache, before)
    out = paged_attention(q, k, v, cache, meta, 0.25)
    assert out.dtype == torch.bfloat16
    for i, past in enumerate(histories):
        ks, vs = (torch.cat([past[j].half(), new[i:i + 1].half()]).float() for j, new in ((0, k), (1, v)))
        ref = _dense_reference(q[i].float(), ks, vs, 0.25)
        torch.testing.assert_close(out[i].float(), ref, rtol=2e-2, atol=2e-2)


def test_layers_sharing_the_step_workspace_read_their_own_cache(monkeypatch):
    monkeypatch.setitem(cpu_kernels._state, "ops", None)  # the workspace belongs to the plain-torch path
    q, k, v, cache, meta, _ = _step([6, 11], 6, 2, 16, seed=1)
    other = torch.randn_like(cache)
    first = paged_attention(q, k, v, cache.clone(), meta, 0.25)
    workspace = meta.decode_kv_workspace
    paged_attention(q, k, v, other, meta, 0.25)  # another layer: same workspace, other values
    assert meta.decode_kv_workspace is workspace
    again = paged_attention(q, k, v, cache.clone(), meta, 0.25)
    torch.testing.assert_close(again, first, rtol=0, atol=0)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_a_mixed_step_matches_dense_causal_attention_per_request(cache_dtype, decode_path):
    # Requests in packed order: a decode, two fresh prompts of 5 tokens (one SDPA batch), a fresh 7,
    # a chunk of 4 after 6 cached tokens, a fresh 5 again (not adjacent to the first two) and a fresh 3.
    # A bf16 cache: fresh prompts attend over their own fp32 k / v, the decode and the chunk over the
    # cache's rounded values (their new rows included), widened to fp32. Through the C++ kernels (decode and
    # prefill attention) and through plain torch.
    # query lens, cached tokens
    reqs = [(1, 9), (5, 0), (5, 0), (7, 0), (4, 6), (5, 0), (3, 0)]
    num_heads, num_kv_heads, head_dim = 6, 2, 16
    gen = torch.Generator().manual_seed(4)
    num_blocks = sum(-(-(n + c) // BLOCK_SIZE) for n, c in reqs) + 2
    order = torch.randperm(num_blocks, generator=gen).tolist()
    cache = torch.zeros(2, num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    tables, pasts = [], []
    for n, cached in reqs:
        table = [order.pop() for _ in range(-(-(n + cached) // BLOCK_SIZE))]
        past = torch.randn(2, cached, num_kv_heads, head_dim, generator=gen)
        for p in range(cached):
            cache[:, table[p // BLOCK_SIZE], p % BLOCK_SIZE] = past[:, p]
        tables.append(table)
        pasts.append(past)
    query_lens = np.array([n for n, _ in reqs])
    starts = np.array([c for _, c in reqs])
    positions = np.concatenate([np.arange(c, c + n) for n, c in reqs])
    meta = build_attention_metadata(query_lens, starts, positions, tables, BLOCK_SIZE, torch.device("cpu"))
    assert [(p.count, p.token_end - p.token_start) for p in meta.prefills] == [(2, 10), (1, 7), (1, 4), (1, 5),
                                                                                (1, 3)]
    t = int(query_lens.sum())
    q = torch.randn(t, num_heads, head_dim, generator=gen)
    k = torch.randn(t, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(t, num_kv_heads, head_dim, generator=gen)
    out = paged_attention(q, k, v, cache.to(cache_dtype), meta, 0.3)
    row = 0
    for (n, cached), past in zip(reqs, pasts):
        rows = slice(row, row + n)
        ks, vs = torch.cat([past[0], k[rows]]), torch.cat([past[1], v[rows]])
        if cached:  # read back from the cache
            ks, vs = ks.to(cache_dtype).float(), vs.to(cache_dtype).float()
        mask = torch.arange(cached + n)[None, :] <= torch.arange(cached, cached + n)[:, None]
        ref = F.scaled_dot_product_attention(q[rows].transpose(0, 1)[None], ks.transpose(0, 1)[None],
                                             vs.transpose(0, 1)[None], attn_mask=mask, scale=0.3, enable_gqa=True)
        torch.testing.assert_close(out[rows], ref[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
        row += n


def test_decode_kernel_stores_strided_k_v_at_their_slots(kernels):
    # k / v as the qkv split leaves them: row-strided views. The kernel writes them into the cache
    # itself; cache and output must equal the torch path's (index_copy_, then attention).
    q, _, _, cache, meta, histories = _step([3, 17, 40], 9, 3, 64, seed=5)
    packed = torch.randn(3, 2 * 3 * 64 + 7)
    k, v = packed[:, :192].view(3, 3, 64), packed[:, 192:384].view(3, 3, 64)
    assert not k.is_contiguous()
    fused_cache, torch_cache = cache.clone(), cache.clone()
    out = paged_attention(q, k, v, fused_cache, meta, 0.125)
    flat = torch_cache.view(2, -1, 3, 64)
    flat[0, meta.slot_mapping], flat[1, meta.slot_mapping] = k, v
    assert torch.equal(fused_cache, torch_cache)
    for i, past in enumerate(histories):
        ks, vs = torch.cat([past[0], k[i:i + 1]]), torch.cat([past[1], v[i:i + 1]])
        torch.testing.assert_close(out[i], _dense_reference(q[i], ks, vs, 0.125), rtol=1e-5, atol=1e-5)


def test_decode_kernel_refuses_a_slot_outside_the_cache(kernels):
    q, k, v, cache, meta, _ = _step([3, 5], 4, 2, 16, seed=6)
    slots = meta.slot_mapping.clone()
    slots[1] = cache.shape[1] * cache.shape[2]
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernels.paged_decode_write(q, k, v, cache, slots, meta.decode_block_tables, meta.decode_context_lens, 0.25)


@pytest.mark.parametrize("src_dtype, cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                    (torch.float16, torch.float16), (torch.float32, torch.bfloat16),
                                                    (torch.float32, torch.float16)])
@pytest.mark.parametrize("rows", [1, 300, 2048])  # one thread, and split across threads from 256 rows on
def test_kv_write_kernel_stores_what_index_copy_stores(src_dtype, cache_dtype, rows, kernels):
    """write_kv's CPU kernel (prefill k / v, strided views of a qkv row, on shuffled slots) against torch's
    index_copy_ with the cast, bit for bit (fp32 into a half cache is rounded as .to() rounds)."""
    gen = torch.Generator().manual_seed(rows)
    packed = (torch.randn(rows, 2 * 3 * 64 + 5, generator=gen) * 100).to(src_dtype)
    k, v = packed[:, :192].view(rows, 3, 64), packed[:, 192:384].view(rows, 3, 64)
    cache = torch.randn(2, rows // 16 + 4, 16, 3, 64, generator=gen).to(cache_dtype)
    slots = torch.randperm(cache.shape[1] * 16, generator=gen)[:rows]
    expected = cache.clone()
    expected[0].view(-1, 3, 64).index_copy_(0, slots, k.to(cache_dtype))
    expected[1].view(-1, 3, 64).index_copy_(0, slots, v.to(cache_dtype))
    kernels.paged_kv_write(k, v, cache, slots)
    assert torch.equal(cache, expected)


def test_write_kv_takes_the_kernel_on_the_cpu(kernels, monkeypatch):
    calls = []
    monkeypatch.setattr(attention.cpu_kernels, "ops", lambda: type("K", (), {
        "paged_kv_write": staticmethod(lambda *a: calls.append(a) or kernels.paged_kv_write(*a))}))
    cache = torch.zeros(2, 4, 4, 2, 8)
    k, v = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    attention.write_kv(cache, k, v, torch.tensor([0, 3, 7, 8, 15]))
    assert len(calls) == 1 and torch.equal(cache[0].view(-1, 2, 8)[[0, 3, 7, 8, 15]], k)
    attention.write_kv(cache, k.half(), v.half(), torch.tensor([1, 2, 4, 5, 6]))  # fp16 into fp32: torch's copy
    assert len(calls) == 1 and torch.equal(cache[1].view(-1, 2, 8)[[1, 2, 4, 5, 6]], v.half().float())


def test_kv_write_kernel_checks_every_slot_before_storing(kernels):
    cache = torch.zeros(2, 2, 4, 2, 8)
    k = v = torch.ones(3, 2, 8)
    with pytest.raises(RuntimeError, match="paged_kv_write: slot 8 outside the cache's 8"):
        kernels.paged_kv_write(k, v, cache, torch.tensor([0, 1, 8]))
    assert not cache.any()  # nothing was stored
    with pytest.raises(RuntimeError, match="each row contiguous"):
        kernels.paged_kv_write(torch.ones(3, 8, 2).transpose(1, 2), v, cache, torch.tensor([0, 1, 2]))
    with pytest.raises(RuntimeError, match="slots must be"):
        kernels.paged_kv_write(k, v, cache, torch.tensor([0, 1, 2], dtype=torch.int32))


def _causal_reference(q, k, v, count, scale):
    """count sequences back to back, q [count * Tq, Hq, D] over k / v [count * Tk, Hk, D] (Tk - Tq cached first)."""
    outs = []
    for qs, ks, vs in zip(q.chunk(count), k.chunk(count), v.chunk(count)):
        tq, tk = qs.shape[0], ks.shape[0]
        mask = torch.arange(tk)[None, :] <= torch.arange(tk - tq, tk)[:, None]
        out = F.scaled_dot_product_attention(qs.transpose(0, 1)[None], ks.transpose(0, 1)[None],
                                             vs.transpose(0, 1)[None], attn_mask=mask, scale=scale, enable_gqa=True)
        outs.append(out[0].transpose(0, 1))
    return torch.cat(outs)


# SmolLM2's heads, Qwen3.5's (head_dim 256), no grouping; query counts around the 6-row tile and the 48-query
# work item; fresh prompts and chunks after a cached prefix (keys not a multiple of the 16-key panel).
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(9, 3, 64), (8, 2, 256), (4, 4, 16), (6, 2, 32)])
@pytest.mark.parametrize("count, tq, prefix", [(1, 1, 0), (3, 5, 0), (2, 47, 0), (1, 49, 0), (2, 100, 0),
                                               (1, 7, 13), (1, 50, 30)])
def test_prefill_kernel_matches_causal_sdpa(num_heads, num_kv_heads, head_dim, count, tq, prefix, kernels):
    gen = torch.Generator().manual_seed(tq + prefix)
    tk = tq + prefix
    width = (num_heads + 2 * num_kv_heads) * head_dim
    packed = torch.randn(count * tq, width + 5, generator=gen)  # the qkv projection's split views: strided rows
    q = packed[:, :num_heads * head_dim].unflatten(1, (num_heads, head_dim))
    if prefix:  # gathered from the cache: contiguous, the whole context
        k, v = torch.randn(2, count * tk, num_kv_heads, head_dim, generator=gen)
    else:
        k = packed[:, num_heads * head_dim:width - num_kv_heads * head_dim].unflatten(1, (num_kv_heads, head_dim))
        v = packed[:, width - num_kv_heads * head_dim:width].unflatten(1, (num_kv_heads, head_dim))
    assert count * tq == 1 or q.stride(0) == width + 5
    out = torch.full((count * tq, num_heads, head_dim), float("nan"))
    kernels.prefill_attention(out, q, k, v, count, 0.2)
    # against fp64 attention: SDPA's fp32 result is itself off by up to ~1e-5 here (head_dim 256, 100 keys)
    ref = _causal_reference(q.double(), k.double(), v.double(), count, 0.2)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_prefill_kernel_softmax_over_large_scores_and_long_prompts(kernels):
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(700, 4, 64, generator=gen) * 30  # scores in the hundreds: exp needs the max subtracted
    k, v = torch.randn(2, 700, 2, 64, generator=gen)
    out = torch.empty_like(q)
    kernels.prefill_attention(out, q, k, v, 1, 0.125)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, _causal_reference(q, k, v, 1, 0.125), rtol=1e-4, atol=1e-4)


def test_prefill_kernel_refuses_what_it_cannot_run(kernels):
    q, k = torch.randn(6, 4, 64), torch.randn(6, 2, 64)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        kernels.prefill_attention(torch.empty(6, 4, 24), torch.randn(6, 4, 24), *torch.randn(2, 6, 2, 24), 1, 1.0)
    with pytest.raises(RuntimeError, match="fewer keys"):
        kernels.prefill_attention(torch.empty_like(q), q, k[:4], k[:4], 1, 1.0)
    with pytest.raises(RuntimeError, match="3 query heads over 2"):
        kernels.prefill_attention(torch.empty(6, 3, 64), torch.randn(6, 3, 64), k, k, 1, 1.0)
    with pytest.raises(RuntimeError, match="fp32 or bf16"):  # mixed dtypes
        kernels.prefill_attention(torch.empty_like(q), q.bfloat16(), k, k, 1, 1.0)
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        kernels.prefill_attention(torch.empty_like(q).half(), q.half(), k.half(), k.half(), 1, 1.0)


@pytest.mark.parametrize("head_dim", [24, 64])
def test_prefill_goes_to_sdpa_where_the_kernel_does_not_run(head_dim, kernels, monkeypatch):
    # head_dim 24 is not a multiple of the kernel's 16-wide panels: paged_attention must take SDPA (and agree).
    calls = []
    real = attention._sdpa
    monkeypatch.setattr(attention, "_sdpa", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    meta = build_attention_metadata(np.array([9]), np.array([0]), np.arange(9), [[0, 1, 2]], BLOCK_SIZE,
                                    torch.device("cpu"))
    gen = torch.Generator().manual_seed(8)
    q, k, v = torch.randn(9, 4, head_dim, generator=gen), *torch.randn(2, 9, 2, head_dim, generator=gen)
    out = paged_attention(q, k, v, torch.zeros(2, 3, BLOCK_SIZE, 2, head_dim), meta, 0.3)
    assert len(calls) == (head_dim == 24)
    torch.testing.assert_close(out, _causal_reference(q, k, v, 1, 0.3), rtol=1e-5, atol=1e-5)


# A model run in bf16 straight through the kernel (strided rows, a cached prefix, several sequences): each value widened
# as it is packed, fp32 arithmetic, the result rounded once: exactly the fp32 kernel on widened copies, rounded; on AMX
# or vdpbf16ps (head_dim a multiple of 32) the tiles' products, to within the output's rounding.
@pytest.mark.parametrize("count, tq, prefix", [(1, 37, 0), (3, 20, 0), (2, 9, 14), (1, 300, 0), (2, 50, 100)])
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(9, 3, 64), (8, 2, 256), (4, 4, 32), (2, 1, 48)])
def test_bf16_prefill_kernel_is_the_fp32_kernel_rounded_once(count, tq, prefix, num_heads, num_kv_heads, head_dim,
                                                            kernels):
    gen = torch.Generator().manual_seed(21)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    packed = torch.randn(count * tq, width + 3, generator=gen).bfloat16()
    q = packed[:, :num_heads * head_dim].unflatten(1, (num_heads, head_dim))
    if prefix:
        k, v = torch.randn(2, count * (tq + prefix), num_kv_heads, head_dim, generator=gen).bfloat16()
    else:
        k = packed[:, num_heads * head_dim:width - num_kv_heads * head_dim].unflatten(1, (num_kv_heads, head_dim))
        v = packed[:, width - num_kv_heads * head_dim:width].unflatten(1, (num_kv_heads, head_dim))
    out = torch.full((count * tq, num_heads, head_dim), float("nan"), dtype=torch.bfloat16)
    kernels.prefill_attention(out, q, k, v, count, 0.2)
    wide_out = torch.empty(out.shape)
    kernels.prefill_attention(wide_out, q.float(), k.float(), v.float(), count, 0.2)
    if not (kernels.prefill_attention_amx() or kernels.prefill_attention_dot()):
        assert torch.equal(out, wide_out.bfloat16())
        return
    # On AMX or vdpbf16ps: Q K^T's exact products summed in another order, P V as P's bf16 high and low parts: within the output's
    # own rounding of the fp32 result, and nearly always the same bf16 value (SDPA's bf16 path, rounding P to bf16
    # once, matches far fewer).
    torch.testing.assert_close(out.float(), wide_out, rtol=2 ** -8, atol=1e-5)
    same = (out == wide_out.bfloat16()).float().mean().item()
    assert same > (0.97 if head_dim % 32 == 0 else 1.0 - 1e-9), same  # head_dim 48: the fp32 loops, exactly


def test_the_bf16_prefill_takes_vdpbf16ps_where_the_cpu_has_avx512_bf16_without_amx(kernels):
    from ascendserve.platforms.cpu import cpu_flags
    has = "avx512_bf16" in cpu_flags()
    assert kernels.prefill_attention_dot() == (has and not kernels.prefill_attention_amx())


def test_bf16_prefill_beyond_the_amx_head_dim_is_the_fp32_kernel_rounded_once(kernels):
    # head_dim 544 (a multiple of 32, but more than the AMX path's 512: its key rows are staged in a 256-pair buffer)
    # takes the portable loops: exactly the fp32 kernel rounded.
    gen = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(3, 2 * 19, 2, 544, generator=gen).bfloat16()
    out = torch.empty_like(q)
    kernels.prefill_attention(out, q, k, v, 2, 0.05)
    wide_out = torch.empty(out.shape)
    kernels.prefill_attention(wide_out, q.float(), k.float(), v.float(), 2, 0.05)
    assert torch.equal(out, wide_out.bfloat16())


@pytest.mark.parametrize("head_dim", [24, 64])
def test_bf16_prefill_takes_the_kernel_in_bf16(head_dim, kernels, monkeypatch):
    # A model run in bf16: the kernel on the bf16 values, the output rounded once (SDPA where head_dim rules it out).
    calls = []
    real = attention._sdpa
    monkeypatch.setattr(attention, "_sdpa", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    meta = build_attention_metadata(np.array([9, 5]), np.array([0, 0]), np.r_[np.arange(9), np.arange(5)],
                                    [[0, 1, 2], [3, 4]], BLOCK_SIZE, torch.device("cpu"))
    gen = torch.Generator().manual_seed(9)
    q, k, v = (t.bfloat16() for t in (torch.randn(14, 4, head_dim, generator=gen),
                                      *torch.randn(2, 14, 2, head_dim, generator=gen)))
    out = paged_attention(q, k, v, torch.zeros(2, 5, BLOCK_SIZE, 2, head_dim, dtype=torch.bfloat16), meta, 0.3)
    assert out.dtype == torch.bfloat16 and len(calls) == (2 if head_dim == 24 else 0)
    ref = torch.cat([_causal_reference(*(t[rows].float() for t in (q, k, v)), 1, 0.3)
                     for rows in (slice(0, 9), slice(9, 14))])
    if head_dim == 64:  # the fp32 result rounded to bf16 once: within a bf16 step of the reference
        torch.testing.assert_close(out.float(), ref, rtol=2.0 ** -8, atol=1e-3)
    else:
        torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
