"""Paged attention in plain torch: write new K/V into blocks, attend over each request's blocks.

KV cache of one layer: [2, num_blocks, block_size, num_kv_heads, head_dim]. A token at position p
of a request with block table bt lives at slot bt[p // block_size] * block_size + p % block_size.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillSeq:
    """One request with more than one new token this step."""

    token_start: int  # its rows in the packed batch: [token_start, token_end)
    token_end: int
    kv_slots: torch.Tensor | None  # [context_len] slots of all its tokens; None if no cached prefix
    mask: torch.Tensor | None  # [q_len, context_len] bool, True = may attend; None = plain causal


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step, built once by the runner and shared by all layers."""

    slot_mapping: torch.Tensor  # [T] cache slot of every new token
    decode_token_idx: torch.Tensor | None  # [Bd] rows of the single-token requests
    decode_kv_slots: torch.Tensor | None  # [Bd, max_context] slots (padded with slot 0)
    decode_mask: torch.Tensor | None  # [Bd, 1, 1, max_context] bool, False on padding
    prefills: list[PrefillSeq]


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store k, v [T, Hk, D] at their slots."""
    k_flat = kv_cache[0].view(-1, *k.shape[1:])
    v_flat = kv_cache[1].view(-1, *v.shape[1:])
    k_flat.index_copy_(0, slot_mapping, k)
    v_flat.index_copy_(0, slot_mapping, v)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Causal attention of the new tokens q/k/v [T, H, D] over their cached context -> [T, Hq, D].

    Every layer writes all new K/V first, so requests in the same step can read blocks that
    another request fills in this very step (shared prefix blocks).
    """
    write_kv(kv_cache, k, v, meta.slot_mapping)
    out = torch.empty_like(q)
    k_flat = kv_cache[0].view(-1, *k.shape[1:])
    v_flat = kv_cache[1].view(-1, *v.shape[1:])
    if meta.decode_token_idx is not None:
        out[meta.decode_token_idx] = _decode(q[meta.decode_token_idx], k_flat, v_flat, meta, scale)
    for seq in meta.prefills:
        rows = slice(seq.token_start, seq.token_end)
        if seq.kv_slots is None:
            ks, vs = k[rows], v[rows]
        else:
            ks, vs = k_flat[seq.kv_slots], v_flat[seq.kv_slots]
        out[rows] = _sdpa(q[rows].unsqueeze(0), ks.unsqueeze(0), vs.unsqueeze(0), seq.mask, scale)[0]
    return out


def _decode(q, k_flat, v_flat, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    ks = k_flat[meta.decode_kv_slots]  # [Bd, ctx, Hk, D]
    vs = v_flat[meta.decode_kv_slots]
    return _sdpa(q.unsqueeze(1), ks, vs, meta.decode_mask, scale, causal=False)[:, 0]


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


def build_attention_metadata(query_lens: list[int], start_positions: list[int],
                             block_tables: list[list[int]], block_size: int,
                             device: torch.device) -> AttentionMetadata:
    """Turn per-request (new tokens, start position, block table) into gather indices and masks.

    Example, block_size 4: a request with block table [7, 2] and 6 tokens has slots
    [28, 29, 30, 31, 8, 9].
    """
    slots, decode_rows, decode_ctx, prefills = [], [], [], []
    row = 0
    for q_len, start, table in zip(query_lens, start_positions, block_tables):
        ctx = start + q_len
        all_slots = _slots(table, ctx, block_size)
        slots.extend(all_slots[start:])
        if q_len == 1:
            decode_rows.append(row)
            decode_ctx.append(all_slots)
        else:
            prefills.append(_prefill_seq(row, q_len, start, all_slots, device))
        row += q_len
    meta = AttentionMetadata(torch.tensor(slots, dtype=torch.long, device=device), None, None, None, prefills)
    if decode_rows:
        max_ctx = max(len(s) for s in decode_ctx)
        padded = [s + [0] * (max_ctx - len(s)) for s in decode_ctx]
        lens = torch.tensor([len(s) for s in decode_ctx], device=device)
        meta.decode_token_idx = torch.tensor(decode_rows, dtype=torch.long, device=device)
        meta.decode_kv_slots = torch.tensor(padded, dtype=torch.long, device=device)
        meta.decode_mask = (torch.arange(max_ctx, device=device)[None, :] < lens[:, None])[:, None, None, :]
    return meta


def _slots(table: list[int], num_tokens: int, block_size: int) -> list[int]:
    return [table[p // block_size] * block_size + p % block_size for p in range(num_tokens)]


def _prefill_seq(row: int, q_len: int, start: int, all_slots: list[int], device) -> PrefillSeq:
    if start == 0:
        return PrefillSeq(row, row + q_len, None, None)
    ctx = start + q_len
    q_pos = torch.arange(start, ctx, device=device)[:, None]
    mask = torch.arange(ctx, device=device)[None, :] <= q_pos
    return PrefillSeq(row, row + q_len, torch.tensor(all_slots, dtype=torch.long, device=device), mask)
