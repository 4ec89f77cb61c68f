"""Gated DeltaNet kernels in plain torch, for packed variable-length batches.

Layout conventions (the engine packs requests without padding):
* Tokens of B sequences are concatenated along dim 0; ``cu_seqlens`` [B+1] holds the boundaries,
  e.g. lengths [2, 3] -> cu_seqlens [0, 2, 5]; sequence b owns tokens ``cu_seqlens[b]:cu_seqlens[b+1]``.
* Per-sequence state lives in a pool indexed by slot: ``state_indices[b]`` is the slot of sequence b.
  Conv state pool: [num_slots, C, K-1] (the last K-1 conv inputs, oldest first).
  Recurrent state pool: [num_slots, Hv, dk, dv], fp32 (HF's layout; vLLM stores the transpose).

Delta-rule conventions follow transformers' ``torch_chunk_gated_delta_rule`` and FLA/vLLM's
``chunk_gated_delta_rule``: q and k are passed as they come out of the conv (not normalized);
``use_qk_l2norm_in_kernel=True`` l2-normalizes them here (eps 1e-6, fp32), and q is then always
multiplied by ``scale`` (default dk**-0.5). If Hk < Hv, q/k heads are repeat-interleaved to Hv
(value head j reads key head j // (Hv // Hk)). All state math is fp32; outputs take q's dtype.
"""

import math

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """x * rsqrt(sum(x^2) + eps) along ``dim`` (the FLA / transformers definition)."""
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def conv_uses_silu(activation: str | None) -> bool:
    """Whether the conv's activation is SiLU ("silu" / "swish") rather than none; any other name is an error."""
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"unsupported conv activation {activation!r}; expected 'silu', 'swish' or None")
    return activation is not None


def _activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    return F.silu(y) if conv_uses_silu(activation) else y


# --------------------------------------------------------------------------------------------------
# Causal depthwise conv1d
# --------------------------------------------------------------------------------------------------


def causal_conv1d_prefill(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_states: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Causal depthwise conv over packed sequences, continuing from and updating ``conv_states``.

    x [T, C]; weight [C, K]; conv_states [num_slots, C, K-1] (updated in place); cu_seqlens [B+1];
    state_indices [B]; has_initial_state [B] bool (False: the left context is zeros and the slot's
    content, possibly garbage, is ignored). Returns activation(conv(x)) [T, C] in x's dtype; the
    conv runs in weight's dtype, as transformers' ``causal_conv1d_fn``.

    Each sequence b is laid out in one buffer behind its K-1 context rows; with K=4, lengths [2, 1]:
        rows  [c0 c0 c0 x0 x1 | c1 c1 c1 x2]     (c_b = the K-1 context columns of slot b)
    A valid (unpadded) conv over the whole buffer gives every token exactly its own sequence's
    window, and the new state of b is the last K-1 rows of its segment, so a sequence shorter
    than K-1 keeps the tail of its old context (or zeros).
    """
    num_tokens, channels = x.shape
    width = weight.shape[1] - 1
    device, wdtype = x.device, weight.dtype
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    batch = cu.numel() - 1
    seq_ids = torch.arange(batch, device=device)
    seq_of_token = torch.repeat_interleave(seq_ids, cu[1:] - cu[:-1], output_size=num_tokens)
    token_rows = torch.arange(num_tokens, device=device) + (seq_of_token + 1) * width
    offsets = torch.arange(width, device=device)
    context_rows = (cu[:-1] + seq_ids * width)[:, None] + offsets  # [B, K-1]
    tail_rows = (cu[1:] + seq_ids * width)[:, None] + offsets  # [B, K-1], last K-1 of segment

    context = conv_states[state_indices].transpose(1, 2).to(wdtype)  # [B, K-1, C]
    context = torch.where(has_initial_state.to(device).view(-1, 1, 1), context, 0.0)
    buf = x.new_empty(num_tokens + batch * width, channels, dtype=wdtype)
    buf[context_rows.flatten()] = context.reshape(-1, channels)
    buf[token_rows] = x.to(wdtype)

    # Output row p of a valid conv reads rows p .. p+K-1; token t's window ends at token_rows[t]. The
    # depthwise conv is K shifted multiply-adds over the buffer's rows, accumulated in fp32 (as the
    # decode step): F.conv1d with groups=C took 128 ms for Qwen3.5's 2048 tokens x 6144 channels on
    # a 2-core CPU (mkldnn's grouped path), these ops a few ms.
    weight32 = weight.float()
    rows = buf.shape[0] - width
    full = buf[:rows].float() * weight32[:, 0]
    for j in range(1, width + 1):
        full.addcmul_(buf[j:rows + j].float(), weight32[:, j])
    y = full[token_rows - width]
    if bias is not None:
        y = y + bias.float()
    y = y.to(wdtype)
    conv_states[state_indices] = buf[tail_rows].transpose(1, 2).to(conv_states.dtype)
    return _activate(y, activation).to(x.dtype)


def causal_conv1d_decode(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_states: torch.Tensor,
    state_indices: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> torch.Tensor:
    """One conv step per sequence: x [B, C] -> [B, C]; shifts x into ``conv_states[state_indices]``."""
    window = torch.cat([conv_states[state_indices].to(weight.dtype), x.to(weight.dtype).unsqueeze(-1)], -1)
    conv_states[state_indices] = window[:, :, 1:].to(conv_states.dtype)
    y = (window.float() * weight.float()).sum(-1).to(weight.dtype)  # fp32 accumulation, as conv1d
    if bias is not None:
        y = y + bias
    return _activate(y, activation).to(x.dtype)


# --------------------------------------------------------------------------------------------------
# Gated delta rule
# --------------------------------------------------------------------------------------------------


def _prepare_qk(
    q: torch.Tensor, k: torch.Tensor, num_v_heads: int, scale: float | None, use_qk_l2norm_in_kernel: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 q, k [..., Hv, dk]: repeat-interleaved to Hv heads, optionally l2-normalized, q scaled."""
    num_k_heads = k.shape[-2]
    if num_v_heads % num_k_heads:
        raise ValueError(f"value heads ({num_v_heads}) must be a multiple of key heads ({num_k_heads})")
    if num_k_heads != num_v_heads:
        q = q.repeat_interleave(num_v_heads // num_k_heads, dim=-2)
        k = k.repeat_interleave(num_v_heads // num_k_heads, dim=-2)
    q, k = q.float(), k.float()
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    return q * (k.shape[-1] ** -0.5 if scale is None else scale), k


def _chunk_layout(cu_seqlens: torch.Tensor, chunk_size: int, device: torch.device):
    """Where each packed token goes when every sequence is cut into zero-padded chunks.

    Sequence b owns chunks chunk_starts[b] .. chunk_starts[b] + num_chunks[b] - 1; token t of b at
    position p lands in flat row ``dest[t] = chunk_starts[b] * chunk_size + p``. E.g. chunk 4,
    lengths [5, 2] -> num_chunks [2, 1], chunk_starts [0, 2], dest [0 1 2 3 4 8 9].
    """
    bounds = cu_seqlens.tolist()  # host copy: chunk counts drive the Python scan loop
    lengths = [end - start for start, end in zip(bounds[:-1], bounds[1:])]
    num_chunks = [math.ceil(n / chunk_size) for n in lengths]
    chunk_starts = [sum(num_chunks[:b]) for b in range(len(num_chunks))]
    seq_of_token = torch.repeat_interleave(
        torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device), output_size=bounds[-1]
    )
    starts_t = torch.tensor(chunk_starts, device=device, dtype=torch.long)
    cu = torch.tensor(bounds, device=device, dtype=torch.long)
    dest = starts_t[seq_of_token] * chunk_size + torch.arange(bounds[-1], device=device) - cu[seq_of_token]
    return dest, num_chunks, chunk_starts


def _to_chunks(x: torch.Tensor, dest: torch.Tensor, total_chunks: int, chunk_size: int) -> torch.Tensor:
    """[T, H, *d] packed tokens -> [N, H, chunk, *d] fp32, zeros after each sequence's end."""
    buf = x.new_zeros(total_chunks * chunk_size, *x.shape[1:], dtype=torch.float32)
    buf[dest] = x.float()
    return buf.view(total_chunks, chunk_size, *x.shape[1:]).transpose(1, 2)


def _intra_chunk(q, k, v, g, beta):
    """Per-chunk terms of the chunked algorithm (transformers l.349-404), for all chunks at once.

    Inputs [N, H, C, d] / [N, H, C]. Zero padding is harmless: a padded position has g=0 (no decay),
    beta=0 and k=v=0, so it neither reads nor writes the state.
    """
    chunk_size = q.shape[-2]
    k_beta, v_beta = k * beta.unsqueeze(-1), v * beta.unsqueeze(-1)
    cum = g.cumsum(-1)
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    # decay[..., i, j] = exp(cum_i - cum_j) for j <= i, else 0: every exponent is <= 0.
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    ut_system = (k_beta @ k.transpose(-1, -2)) * decay
    intra_attn = (q @ k.transpose(-1, -2)) * decay
    new_values = torch.linalg.solve_triangular(ut_system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(
        ut_system, k_beta * cum.exp().unsqueeze(-1), upper=False, unitriangular=True
    )
    q_decayed = q * cum.exp().unsqueeze(-1)
    k_decayed = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]
    return new_values, k_cumdecay, intra_attn, q_decayed, k_decayed, chunk_decay


def _scan_chunks(terms, states: torch.Tensor, num_chunks: list[int], chunk_starts: list[int]):
    """Carry each sequence's state through its chunks; returns (out [N, H, C, dv], final states).

    Step i handles chunk i of every sequence that has one, batched. Sequences are sorted by chunk
    count (descending) so the ones still running are always a prefix of the sorted state batch.
    """
    new_values, k_cumdecay, intra_attn, q_decayed, k_decayed, chunk_decay = terms
    order = sorted(range(len(num_chunks)), key=lambda b: -num_chunks[b])
    order_t = torch.tensor(order, device=states.device, dtype=torch.long)
    starts = torch.tensor([chunk_starts[b] for b in order], device=states.device, dtype=torch.long)
    sorted_counts = [num_chunks[b] for b in order]
    state = states[order_t]  # a copy, [B, H, dk, dv]
    out = torch.empty_like(new_values)
    for i in range(sorted_counts[0] if sorted_counts else 0):
        active = sum(1 for n in sorted_counts if n > i)
        idx = starts[:active] + i
        s = state[:active]
        v_new = new_values[idx] - k_cumdecay[idx] @ s
        out[idx] = q_decayed[idx] @ s + intra_attn[idx] @ v_new
        state[:active] = s * chunk_decay[idx] + k_decayed[idx].transpose(-1, -2) @ v_new
    final = torch.empty_like(state)
    final[order_t] = state
    return out, final


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_states: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    chunk_size: int = 64,
    *,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked gated delta rule over packed sequences (prefill, or prefill continuing a state).

    q, k [T, Hk, dk] (Hk divides Hv); v [T, Hv, dv]; g [T, Hv] log-decay (<= 0); beta [T, Hv];
    initial_states [B, Hv, dk, dv] (None = zeros; gather it from the pool, zeroing fresh sequences);
    cu_seqlens [B+1]. See the module docstring for l2norm / scale. Returns o [T, Hv, dv] in q's
    dtype and final states [B, Hv, dk, dv] fp32; equals ``torch_chunk_gated_delta_rule`` run on
    each sequence alone.

    Cost: one host sync on cu_seqlens, then all intra-chunk work batched over every chunk of every
    sequence and head; the inter-chunk scan is a Python loop over max(chunks per sequence), batched
    over the sequences still running.
    """
    out_dtype, num_v_heads, dk, dv = q.dtype, v.shape[1], k.shape[-1], v.shape[-1]
    q, k = _prepare_qk(q, k, num_v_heads, scale, use_qk_l2norm_in_kernel)
    batch = cu_seqlens.numel() - 1
    if initial_states is None:
        initial_states = torch.zeros(batch, num_v_heads, dk, dv, dtype=torch.float32, device=v.device)
    dest, num_chunks, chunk_starts = _chunk_layout(cu_seqlens, chunk_size, v.device)
    total = sum(num_chunks)
    chunks = [_to_chunks(x, dest, total, chunk_size) for x in (q, k, v, g, beta)]
    terms = _intra_chunk(*chunks)
    out, final_states = _scan_chunks(terms, initial_states.float(), num_chunks, chunk_starts)
    out = out.transpose(1, 2).reshape(total * chunk_size, num_v_heads, dv)[dest]
    return out.to(out_dtype), final_states


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    state_indices: torch.Tensor,
    *,
    slot_block: "tuple[int, torch.Tensor | None] | None" = None,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
) -> torch.Tensor:
    """One decode step per sequence, updating ``states[state_indices]`` in place.

    q, k [B, Hk, dk]; v [B, Hv, dv]; g, beta [B, Hv]; states: the pool [num_slots, Hv, dk, dv]
    (fp32, or bf16 / fp16: computed in fp32, rounded once as the step stores it); state_indices [B],
    distinct valid slots. Returns o [B, Hv, dv] in q's dtype. Same math as
    ``torch_recurrent_gated_delta_rule``: S = exp(g) S; S += k (x) beta (v - S^T k); o = S^T q.

    ``slot_block = (first, order)`` says the slots are exactly first .. first+B-1 (``order``: the
    rows by ascending slot, None if already so): the pool is then updated in place, without
    gathering and scattering the states.

    The step is memory-bound on the states (1 MiB per sequence and layer for Qwen3.5-0.8B), so it
    touches them as few times as the math allows: one batched matmul reads S^T [k q], then S is
    scaled and updated in place (o = d S^T q + (k.q) delta needs no pass over the new S).
    """
    out_dtype = q.dtype
    q, k = _prepare_qk(q, k, v.shape[1], scale, use_qk_l2norm_in_kernel)
    v, g, beta = v.float(), g.float(), beta.float()
    if slot_block is not None:
        first, order = slot_block
        if order is not None:
            q, k, v, g, beta = q[order], k[order], v[order], g[order], beta[order]
        s = states[first:first + k.shape[0]]
    else:
        s = states.index_select(0, state_indices)
    stored = s  # a bf16 / fp16 pool: the step runs on an fp32 copy, rounded back once at the end
    if s.dtype != torch.float32:
        s = s.float()
    batch, heads, dk = k.shape
    s_rows = s.view(batch * heads, dk, -1)
    decay = g.exp().unsqueeze(-1)  # [B, H, 1]
    kq = torch.stack([k, q], dim=-1).reshape(batch * heads, dk, 2)
    s_kq = torch.bmm(s_rows.transpose(1, 2), kq).view(batch, heads, -1, 2)  # [B, H, dv, (S^T k, S^T q)]
    delta = (v - decay * s_kq[..., 0]) * beta.unsqueeze(-1)
    out = decay * s_kq[..., 1] + (k * q).sum(-1, keepdim=True) * delta
    s_rows.mul_(decay.reshape(-1, 1, 1)).baddbmm_(k.reshape(batch * heads, dk, 1),
                                                 delta.reshape(batch * heads, 1, -1))
    if stored is not s:
        stored.copy_(s)
    if slot_block is None:
        states.index_copy_(0, state_indices, stored)
    elif slot_block[1] is not None:
        out = torch.empty_like(out).index_copy_(0, slot_block[1], out)
    return out.to(out_dtype)
