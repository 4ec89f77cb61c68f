"""Triton kernels for GPUs: Gated DeltaNet's conv and recurrent update (decode rows and prefill sequences) and paged
decode attention.

Each replaces a chain of small torch ops with one launch that reads its state slot or cache blocks in place. On an
H200 a Qwen3.5-0.8B decode step was ~2170 kernel-launching ops, the 18 Gated DeltaNet layers 954 of them (casts,
l2norm, bmm, baddbmm, index_copy), and decode attention gathered every block of every request into a workspace to
mask it for SDPA (BENCHMARKS.md, run 99); its prefill ran the chunked form's ~80 ops a layer. The same math as the
plain-torch forms (layers/gated_deltanet.py and layers/attention.py), sums in another order (the prefill's recurrence
token by token, as the CPU's C++ op, or chunked as the torch form, in two launches); the conv and the delta rule round
where those do (but the chunked form's products in a bf16 model, on bf16 operands: delta_dot), attention stays fp32
throughout (as the CPU kernel). Imported only through layers/triton_kernels.py;
under Triton's interpreter (TRITON_INTERPRET=1) the kernels run on CPU tensors, which is how the tests check them.
"""

import functools
import os

import torch
import triton
import triton.language as tl

from ascendserve.layers.gated_deltanet import conv_uses_silu

CONV_BLOCK = 128  # channels per conv program
STATE_BLOCK_V = 32  # value columns of the recurrent state per program: a [dk, 32] fp32 tile (dk 128: 16 KiB)
# Every launch's compile options: multiplies and adds fused into FMAs, Triton 3.9's default, asked for by name: its
# 3.10 turns the default off, and 3.9 warns on each process's first compile where nothing says which.
LAUNCH_OPTIONS = dict(enable_fp_fusion=True)


def _pow2(n: int, least: int = 16) -> int:
    """The block a dimension of n takes: a power of two >= n (tl.arange's rule), at least `least` (tl.dot's)."""
    return max(least, triton.next_power_of_2(n))


@triton.jit
def _conv1d_decode_kernel(x_ptr, x_row, w_ptr, w_row, state_ptr, s_slot, s_chan, s_col, slot_ptr, y_ptr, channels,
                          WIDTH: tl.constexpr, SILU: tl.constexpr, BLOCK_C: tl.constexpr):
    """One row's conv step over BLOCK_C channels: y = act(sum_j state[j] w[j] + x w[WIDTH]); state shifts left.

    The window is taken in the weight's dtype (as the torch form concatenates it), summed in fp32 and rounded to
    the weight's dtype before the activation. Each thread loads column j of its channels and stores it at j - 1,
    so no element is read after another thread wrote it.
    """
    row = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = c < channels
    wdt = w_ptr.dtype.element_ty
    sdt = state_ptr.dtype.element_ty
    slot = tl.load(slot_ptr + row).to(tl.int64)
    state_at = state_ptr + slot * s_slot + c * s_chan
    x = tl.load(x_ptr + row * x_row + c, mask=ok, other=0.0).to(wdt)
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(WIDTH):
        col = tl.load(state_at + j * s_col, mask=ok, other=0.0).to(wdt)
        acc += col.to(tl.float32) * tl.load(w_ptr + c * w_row + j, mask=ok, other=0.0).to(tl.float32)
        if j > 0:
            tl.store(state_at + (j - 1) * s_col, col.to(sdt), mask=ok)
    acc += x.to(tl.float32) * tl.load(w_ptr + c * w_row + WIDTH, mask=ok, other=0.0).to(tl.float32)
    tl.store(state_at + (WIDTH - 1) * s_col, x.to(sdt), mask=ok)
    y = acc.to(wdt).to(tl.float32)
    if SILU:
        y = y * tl.sigmoid(y)
    tl.store(y_ptr + row * channels + c, y.to(y_ptr.dtype.element_ty), mask=ok)


def causal_conv1d_decode(x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor, state_indices: torch.Tensor,
                         activation: str | None = "silu") -> torch.Tensor:
    """layers/gated_deltanet.causal_conv1d_decode in one launch: x [B, C] (rows may be strided) -> [B, C] in x's dtype;
    shifts x into conv_states[state_indices] ([num_slots, C, K-1]) in place."""
    silu = conv_uses_silu(activation)
    batch, channels = x.shape
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("causal_conv1d_decode: x and weight need contiguous channels rows")
    out = torch.empty(batch, channels, dtype=x.dtype, device=x.device)
    if batch:
        grid = (batch, triton.cdiv(channels, CONV_BLOCK))
        _conv1d_decode_kernel[grid](x, x.stride(0), weight, weight.stride(0), conv_states, conv_states.stride(0),
                                    conv_states.stride(1), conv_states.stride(2), state_indices, out, channels,
                                    WIDTH=weight.shape[1] - 1, SILU=silu, BLOCK_C=CONV_BLOCK, **LAUNCH_OPTIONS)
    return out


@triton.jit
def _state_tile(state_ptr, s_slot, slot_ptr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr,
                BV: tl.constexpr):
    """A delta-rule program's place: (its row or sequence i, value head h, the dk and BV column indices and their
    masks, the pointers of its [dk, BV] tile in slot_ptr[i]'s state and the tile's mask). Grid: (rows x Hv, dv / BV)."""
    i = tl.program_id(0) // HV
    h = tl.program_id(0) % HV
    kk = tl.arange(0, BK)
    vv = tl.program_id(1) * BV + tl.arange(0, BV)
    k_ok, v_ok = kk < DK, vv < DV
    s_at = state_ptr + tl.load(slot_ptr + i).to(tl.int64) * s_slot + h * DK * DV + kk[:, None] * DV + vv[None, :]
    return i, h, kk, vv, k_ok, v_ok, s_at, k_ok[:, None] & v_ok[None, :]


@triton.jit
def _delta_rule_token(s, x_at, ba_at, kh, h, kk, vv, k_ok, v_ok, a_decay, dt_bias, scale, key_dim, HV: tl.constexpr,
                      DK: tl.constexpr, DV: tl.constexpr):
    """One token's update of value head h's [dk, BV] state tile s (fp32) -> (new s, the output's BV columns): gates
    from (b, a), l2-normalized q / k, then S = exp(g) S; S += k (x) beta (v - S^T k); o = S^T q. x_at / ba_at: the
    token's conv output and in_proj_ba rows."""
    q = tl.load(x_at + kh * DK + kk, mask=k_ok, other=0.0).to(tl.float32)
    k = tl.load(x_at + key_dim + kh * DK + kk, mask=k_ok, other=0.0).to(tl.float32)
    v = tl.load(x_at + 2 * key_dim + h * DV + vv, mask=v_ok, other=0.0).to(tl.float32)
    q = q * tl.rsqrt(tl.sum(q * q, 0) + 1e-6) * scale
    k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
    b = tl.load(ba_at + h)
    s = s * tl.exp(_log_decay(tl.load(ba_at + HV + h), a_decay, dt_bias))
    s += k[:, None] * ((v - tl.sum(s * k[:, None], 0)) * _beta(b))[None, :]
    return s, tl.sum(s * q[:, None], 0)


@triton.jit
def _beta(b):
    """sigmoid(b), rounded to b's dtype as the torch path computes it, as fp32."""
    return tl.sigmoid(b.to(tl.float32)).to(b.dtype).to(tl.float32)


@triton.jit
def _log_decay(a, a_decay, dt_bias):
    """g = -exp(A_log) softplus(a + dt_bias) in fp32 (softplus linear past 20, as torch's); a_decay = -exp(A_log)."""
    a = a.to(tl.float32) + dt_bias
    return a_decay * tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(tl.minimum(a, 20.0))))


@triton.jit
def _gated_delta_rule_decode_kernel(x_ptr, x_row, ba_ptr, ba_row, a_log_ptr, dt_bias_ptr, state_ptr, s_slot, slot_ptr,
                                    out_ptr, scale, key_dim, HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr,
                                    DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """Value head h of one row, BV of its dv columns: the slot's [dk, BV] tile read, updated and written once."""
    row, h, kk, vv, k_ok, v_ok, s_at, s_ok = _state_tile(state_ptr, s_slot, slot_ptr, HV, DK, DV, BK, BV)
    s, o = _delta_rule_token(tl.load(s_at, mask=s_ok, other=0.0).to(tl.float32), x_ptr + row * x_row,
                             ba_ptr + row * ba_row, h // (HV // HK), h, kk, vv, k_ok, v_ok,
                             -tl.exp(tl.load(a_log_ptr + h).to(tl.float32)), tl.load(dt_bias_ptr + h).to(tl.float32),
                             scale, key_dim, HV, DK, DV)  # value head h reads key head h // (Hv / Hk)
    tl.store(s_at, s.to(state_ptr.dtype.element_ty), mask=s_ok)
    tl.store(out_ptr + (row * HV + h) * DV + vv, o.to(out_ptr.dtype.element_ty), mask=v_ok)


def gated_delta_rule_decode(x: torch.Tensor, ba: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
                            states: torch.Tensor, state_indices: torch.Tensor, num_k_heads: int,
                            head_k_dim: int, head_v_dim: int, scale: float | None = None) -> torch.Tensor:
    """One decode step of the gated delta rule from the conv output, in one launch.

    x [B, 2 Hk dk + Hv dv] (q | k | v after the conv); ba [B, 2 Hv] (b | a, the raw in_proj_ba); states
    [num_slots, Hv, dk, dv] (fp32, bf16 or fp16; fp32 arithmetic, rounded once as stored), updated in place at
    state_indices. Returns o [B, Hv, dv] in x's dtype: what Qwen3_5GatedDeltaNet's torch path gets from
    computing g and beta and calling recurrent_gated_delta_rule(..., use_qk_l2norm_in_kernel=True).
    """
    return _delta_rule(_gated_delta_rule_decode_kernel, x.shape[0], x, ba, a_log, dt_bias, states, (state_indices,),
                       num_k_heads, head_k_dim, head_v_dim, scale)


def _delta_rule(kernel, rows: int, x, ba, a_log, dt_bias, states, slot_args: tuple, num_k_heads: int,
                head_k_dim: int, head_v_dim: int, scale: float | None) -> torch.Tensor:
    """Launch a token-by-token delta-rule kernel over `rows` rows or sequences x Hv heads x dv / BV column blocks:
    its arguments x, ba and the gates' parameters, the state pool, slot_args (the state slots, and for prefill the
    sequence bounds and has_initial_state), the output [T, Hv, dv] in x's dtype."""
    num_v_heads = ba.shape[1] // 2
    _check_layout(kernel.__name__.strip("_").removesuffix("_kernel"), x, ba, states, head_k_dim, head_v_dim)
    out = torch.empty(x.shape[0], num_v_heads, head_v_dim, dtype=x.dtype, device=x.device)
    if x.shape[0] and rows:
        block_v = min(STATE_BLOCK_V, _pow2(head_v_dim))
        kernel[(rows * num_v_heads, triton.cdiv(head_v_dim, block_v))](
            x, x.stride(0), ba, ba.stride(0), a_log, dt_bias, states, states.stride(0), *slot_args, out,
            head_k_dim ** -0.5 if scale is None else scale, num_k_heads * head_k_dim,
            HK=num_k_heads, HV=num_v_heads, DK=head_k_dim, DV=head_v_dim, BK=_pow2(head_k_dim), BV=block_v,
            **LAUNCH_OPTIONS)
    return out


def _check_layout(name: str, x, ba, states, head_k_dim: int, head_v_dim: int) -> None:
    """The delta-rule kernels address x's and ba's rows and each state slot's [Hv, dk, dv] as contiguous."""
    if x.stride(1) != 1 or ba.stride(1) != 1 or states.stride()[1:] != (head_k_dim * head_v_dim, head_v_dim, 1):
        raise ValueError(f"{name}: x and ba need contiguous rows, each state slot contiguous")


@triton.jit
def _conv1d_prefill_kernel(x_ptr, x_row, w_ptr, w_row, state_ptr, s_slot, s_chan, s_col, slot_ptr, cu_ptr, init_ptr,
                           y_ptr, channels, SILU: tl.constexpr, BLOCK_C: tl.constexpr):
    """One sequence's conv over BLOCK_C channels, token by token, for a width-4 conv (Qwen3.5's): the window's three
    older inputs stay in registers (its slot's state where the sequence continues one, else zeros) and go back to the
    slot at the end. The torch form's roundings: inputs in the weight's dtype, sums in fp32 in tap order."""
    seq = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = c < channels
    wdt = w_ptr.dtype.element_ty
    start = tl.load(cu_ptr + seq)
    end = tl.load(cu_ptr + seq + 1)
    state_at = state_ptr + tl.load(slot_ptr + seq).to(tl.int64) * s_slot + c * s_chan
    fresh = tl.load(init_ptr + seq).to(tl.int32) == 0  # a fresh sequence reads zeros, whatever its slot holds
    c0 = tl.where(fresh, 0.0, tl.load(state_at, mask=ok, other=0.0)).to(wdt)
    c1 = tl.where(fresh, 0.0, tl.load(state_at + s_col, mask=ok, other=0.0)).to(wdt)
    c2 = tl.where(fresh, 0.0, tl.load(state_at + 2 * s_col, mask=ok, other=0.0)).to(wdt)
    w0 = tl.load(w_ptr + c * w_row, mask=ok, other=0.0).to(tl.float32)
    w1 = tl.load(w_ptr + c * w_row + 1, mask=ok, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + c * w_row + 2, mask=ok, other=0.0).to(tl.float32)
    w3 = tl.load(w_ptr + c * w_row + 3, mask=ok, other=0.0).to(tl.float32)
    for t in range(start, end):
        x = tl.load(x_ptr + t * x_row + c, mask=ok, other=0.0).to(wdt)
        acc = c0.to(tl.float32) * w0
        acc += c1.to(tl.float32) * w1
        acc += c2.to(tl.float32) * w2
        acc += x.to(tl.float32) * w3
        y = acc.to(wdt).to(tl.float32)
        if SILU:
            y = y * tl.sigmoid(y)
        tl.store(y_ptr + t * channels + c, y.to(y_ptr.dtype.element_ty), mask=ok)
        c0, c1, c2 = c1, c2, x
    sdt = state_ptr.dtype.element_ty
    tl.store(state_at, c0.to(sdt), mask=ok)
    tl.store(state_at + s_col, c1.to(sdt), mask=ok)
    tl.store(state_at + 2 * s_col, c2.to(sdt), mask=ok)


def causal_conv1d_prefill(x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor, cu_seqlens: torch.Tensor,
                          state_indices: torch.Tensor, has_initial_state: torch.Tensor,
                          activation: str | None = "silu") -> torch.Tensor:
    """layers/gated_deltanet.causal_conv1d_prefill for a width-4 conv in one launch: x [T, C] packed sequences (rows
    may be strided) -> [T, C] in x's dtype; each sequence continues from and updates its slot of conv_states."""
    silu = conv_uses_silu(activation)
    if weight.shape[1] != 4:
        raise ValueError(f"causal_conv1d_prefill: a width-4 conv only (Qwen3.5's), got width {weight.shape[1]}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("causal_conv1d_prefill: x and weight need contiguous channels rows")
    tokens, channels = x.shape
    out = torch.empty(tokens, channels, dtype=x.dtype, device=x.device)
    batch = cu_seqlens.numel() - 1
    if tokens and batch:
        _conv1d_prefill_kernel[(batch, triton.cdiv(channels, CONV_BLOCK))](
            x, x.stride(0), weight, weight.stride(0), conv_states, conv_states.stride(0), conv_states.stride(1),
            conv_states.stride(2), state_indices, cu_seqlens, has_initial_state, out, channels,
            SILU=silu, BLOCK_C=CONV_BLOCK, **LAUNCH_OPTIONS)
    return out


@triton.jit
def _gated_delta_rule_prefill_kernel(x_ptr, x_row, ba_ptr, ba_row, a_log_ptr, dt_bias_ptr, state_ptr, s_slot, slot_ptr,
                                     cu_ptr, init_ptr, out_ptr, scale, key_dim, HK: tl.constexpr, HV: tl.constexpr,
                                     DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """Value head h of one sequence, BV of its dv columns: the decode step's update token after token, the state tile
    in registers from the slot (or zeros for a fresh sequence) to the slot."""
    seq, h, kk, vv, k_ok, v_ok, s_at, s_ok = _state_tile(state_ptr, s_slot, slot_ptr, HV, DK, DV, BK, BV)
    s = tl.load(s_at, mask=s_ok, other=0.0).to(tl.float32)
    s = tl.where(tl.load(init_ptr + seq).to(tl.int32) == 0, 0.0, s)  # a fresh sequence starts from zeros
    a_decay = -tl.exp(tl.load(a_log_ptr + h).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    for t in range(tl.load(cu_ptr + seq), tl.load(cu_ptr + seq + 1)):
        s, o = _delta_rule_token(s, x_ptr + t * x_row, ba_ptr + t * ba_row, h // (HV // HK), h, kk, vv, k_ok, v_ok,
                                 a_decay, dt_bias, scale, key_dim, HV, DK, DV)
        tl.store(out_ptr + (t * HV + h) * DV + vv, o.to(out_ptr.dtype.element_ty), mask=v_ok)
    tl.store(s_at, s.to(state_ptr.dtype.element_ty), mask=s_ok)


def gated_delta_rule_prefill(x: torch.Tensor, ba: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
                             states: torch.Tensor, cu_seqlens: torch.Tensor, state_indices: torch.Tensor,
                             has_initial_state: torch.Tensor, num_k_heads: int, head_k_dim: int, head_v_dim: int,
                             scale: float | None = None) -> torch.Tensor:
    """The gated delta rule over packed sequences, token by token in one launch (the recurrence the chunked form
    computes another way, to fp32 rounding): x [T, 2 Hk dk + Hv dv] after the conv, ba [T, 2 Hv]; each sequence starts
    from its slot of states (zeros where has_initial_state is False) and leaves its final state there. Returns
    o [T, Hv, dv] in x's dtype. A sequence's tokens run one after another in each of its Hv x dv / 32 programs: fine
    for prompts of hundreds of tokens; for thousands, chunk_gated_delta_rule takes 64 at a time."""
    return _delta_rule(_gated_delta_rule_prefill_kernel, cu_seqlens.numel() - 1, x, ba, a_log, dt_bias, states,
                       (state_indices, cu_seqlens, has_initial_state), num_k_heads, head_k_dim, head_v_dim, scale)


DELTA_CHUNK = 64  # tokens per chunk of the chunked delta rule (transformers' and FLA's)


def delta_dot(dtype: torch.dtype) -> str:
    """The chunked form's products for activations of `dtype`: an fp32 model's take fp32 operands on tensor cores in
    three TF32 passes, fp32's accuracy (one pass keeps 10 mantissa bits, ~1e-3 relative: more than the fp32 tests
    allow a model's logprobs); a bf16 or fp16 model's round each operand to bf16 (exact products, fp32 sums), as FLA's
    kernels do: half the registers of fp32 tiles, which spill (tests/layers/compile_triton_ops.py reports how much).
    Triton 3.9's interpreter gets bf16 tile products wrong (~1e10 for two 16 x 16 tiles of N(0, 1) values), so there
    the same rounding is followed by an fp32 product ("bf16-emulated")."""
    if dtype == torch.float32:
        return "tf32x3"
    return "bf16-emulated" if os.environ.get("TRITON_INTERPRET") == "1" else "bf16"


DELTA_WARPS = 8


@triton.jit
def _dot(a, b, DOT: tl.constexpr):
    """a @ b with fp32 sums, at delta_dot's precision DOT."""
    if DOT == "bf16":
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    elif DOT == "bf16-emulated":
        return tl.dot(a.to(tl.bfloat16).to(tl.float32), b.to(tl.bfloat16).to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=DOT)


@triton.jit
def _unit_rows(at, row_stride, rows, ok, kk, k_ok):
    """The rows' dk values from `at` (rows past the chunk: zeros), each l2-normalized (eps 1e-6), fp32 [C, BK]."""
    x = tl.load(at + rows[:, None] * row_stride + kk[None, :], mask=ok[:, None] & k_ok[None, :], other=0.0)
    x = x.to(tl.float32)
    return x * tl.rsqrt(tl.sum(x * x, 1) + 1e-6)[:, None]


@triton.jit
def _chunk_prepare_kernel(x_ptr, x_row, ba_ptr, ba_row, a_log_ptr, dt_bias_ptr, cu_ptr, qkw_ptr, u_ptr, aqk_ptr, g_ptr,
                          scale, key_dim, HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                          BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr, DOT: tl.constexpr):
    """Chunk c of one sequence, value head h: everything its chunk needs that does not depend on the state, to scratch
    rows at its tokens. With g the gates' log-decay summed from the chunk's start (g_n at its last token), beta the
    write strength, q and k l2-normalized, and T = (I + A)^-1, A[i, j] = beta_i (k_i . k_j) exp(g_i - g_j) for j < i
    (transformers' forward substitution, row by row): qkw [T, Hv, 3, dk] = (scale exp(g) q, exp(g_n - g) k,
    W = T (beta exp(g) k)), U = T (beta v) [T, Hv, dv] (fp32), the causal scores q_i . k_j exp(g_i - g_j) (j <= i)
    [T, Hv, C] and g [T, Hv] (fp32). qkw and the scores in the dtype the products take them in (delta_dot).
    Grid (sequences, ceil(T / C), Hv): chunks past a sequence's end do nothing."""
    seq = tl.program_id(0)
    first = tl.load(cu_ptr + seq) + tl.program_id(1) * C
    end = tl.load(cu_ptr + seq + 1)
    h = tl.program_id(2)
    if first < end:
        r = tl.arange(0, C)
        rows = first + r
        ok = rows < end
        at = rows * HV + h  # the scratch row of each token
        kk = tl.arange(0, BK)
        k_ok = kk < DK
        tile_ok = ok[:, None] & k_ok[None, :]
        qkw_at = qkw_ptr + at[:, None] * (3 * DK) + kk[None, :]
        kh = h // (HV // HK)
        beta = tl.where(ok, _beta(tl.load(ba_ptr + rows * ba_row + h, mask=ok, other=0.0)), 0.0)
        g = tl.load(ba_ptr + rows * ba_row + HV + h, mask=ok, other=0.0)
        g = tl.cumsum(tl.where(ok, _log_decay(g, -tl.exp(tl.load(a_log_ptr + h).to(tl.float32)),
                                                 tl.load(dt_bias_ptr + h).to(tl.float32)), 0.0), 0)
        g_last = tl.sum(tl.where(r == tl.minimum(end - first, C) - 1, g, 0.0), 0)
        tl.store(g_ptr + at, g, mask=ok)
        decay = tl.exp(tl.where(r[:, None] >= r[None, :], g[:, None] - g[None, :], 0.0))  # exponents <= 0
        k = _unit_rows(x_ptr + key_dim + kh * DK, x_row, rows, ok, kk, k_ok)
        q = _unit_rows(x_ptr + kh * DK, x_row, rows, ok, kk, k_ok) * scale
        causal = (r[:, None] >= r[None, :]) & ok[:, None]
        aqk = tl.where(causal, _dot(q, tl.trans(k), DOT) * decay, 0.0)
        tl.store(aqk_ptr + at[:, None] * C + r[None, :], aqk.to(aqk_ptr.dtype.element_ty), mask=ok[:, None])
        tl.store(qkw_at, (q * tl.exp(g)[:, None]).to(qkw_ptr.dtype.element_ty), mask=tile_ok)
        tl.store(qkw_at + DK, (k * tl.exp(g_last - g)[:, None]).to(qkw_ptr.dtype.element_ty), mask=tile_ok)
        lower = r[:, None] > r[None, :]
        a = tl.where(lower, _dot(k * beta[:, None], tl.trans(k), DOT) * decay, 0.0)
        # T_i = e_i - sum_{j < i} A_ij T_j, i = 1 .. n-1; the rows at and past i are still e_j, and A_ij = 0 there
        t = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
        for i in range(1, tl.minimum(end - first, C)):
            a_i = tl.sum(tl.where(r[:, None] == i, a, 0.0), 0)
            t = tl.where(r[:, None] == i, t - tl.sum(a_i[:, None] * t, 0)[None, :], t)
        w = _dot(t, k * (beta * tl.exp(g))[:, None], DOT)
        tl.store(qkw_at + 2 * DK, w.to(qkw_ptr.dtype.element_ty), mask=tile_ok)
        for v0 in tl.static_range(0, DV, BV):  # U a column block at a time: v is [C, dv]
            vv = v0 + tl.arange(0, BV)
            v_ok = ok[:, None] & (vv < DV)[None, :]
            v = tl.load(x_ptr + rows[:, None] * x_row + 2 * key_dim + h * DV + vv[None, :], mask=v_ok, other=0.0)
            u = _dot(t, v.to(tl.float32) * beta[:, None], DOT)
            tl.store(u_ptr + at[:, None] * DV + vv[None, :], u, mask=v_ok)


@triton.jit
def _chunk_gated_delta_rule_kernel(state_ptr, s_slot, slot_ptr, cu_ptr, init_ptr, qkw_ptr, u_ptr, aqk_ptr, g_ptr,
                                   out_ptr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr,
                                   BV: tl.constexpr, C: tl.constexpr, DOT: tl.constexpr):
    """Value head h of one sequence, BV of its dv columns: the state tile in registers from the slot (zeros for a
    fresh sequence) through the sequence's chunks, C tokens a step (transformers' torch_chunk_gated_delta_rule), from
    _chunk_prepare_kernel's scratch: V' = U - W S; O = (scale exp(g) q) S + scores V';
    S = exp(g_n) S + (exp(g_n - g) k)^T V'. Four products a chunk, each with the state or V'."""
    seq, h, kk, vv, k_ok, v_ok, s_at, s_ok = _state_tile(state_ptr, s_slot, slot_ptr, HV, DK, DV, BK, BV)
    s = tl.load(s_at, mask=s_ok, other=0.0).to(tl.float32)
    s = tl.where(tl.load(init_ptr + seq).to(tl.int32) == 0, 0.0, s)  # a fresh sequence starts from zeros
    r = tl.arange(0, C)
    end = tl.load(cu_ptr + seq + 1)
    for first in range(tl.load(cu_ptr + seq), end, C):
        rows = first + r
        ok = rows < end  # rows past the end read zeros
        at = rows * HV + h
        tile_ok, out_ok = ok[:, None] & k_ok[None, :], ok[:, None] & v_ok[None, :]
        qkw_at = qkw_ptr + at[:, None] * (3 * DK) + kk[None, :]
        g_last = tl.load(g_ptr + (tl.minimum(end, first + C) - 1) * HV + h)
        v_new = tl.load(u_ptr + at[:, None] * DV + vv[None, :], mask=out_ok, other=0.0) - \
            _dot(tl.load(qkw_at + 2 * DK, mask=tile_ok, other=0.0), s, DOT)
        aqk = tl.load(aqk_ptr + at[:, None] * C + r[None, :], mask=ok[:, None], other=0.0)
        o = _dot(tl.load(qkw_at, mask=tile_ok, other=0.0), s, DOT) + _dot(aqk, v_new, DOT)
        tl.store(out_ptr + at[:, None] * DV + vv[None, :], o.to(out_ptr.dtype.element_ty), mask=out_ok)
        s = s * tl.exp(g_last) + _dot(tl.trans(tl.load(qkw_at + DK, mask=tile_ok, other=0.0)), v_new, DOT)
    tl.store(s_at, s.to(state_ptr.dtype.element_ty), mask=s_ok)


def chunk_gated_delta_rule(x: torch.Tensor, ba: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
                           states: torch.Tensor, cu_seqlens: torch.Tensor, state_indices: torch.Tensor,
                           has_initial_state: torch.Tensor, num_k_heads: int, head_k_dim: int, head_v_dim: int,
                           scale: float | None = None) -> torch.Tensor:
    """gated_delta_rule_prefill's contract in the chunked form, two launches: every chunk of every sequence and
    head prepares at once what does not depend on the state (DELTA_CHUNK tokens; scratch of T x Hv x (3 dk +
    DELTA_CHUNK) values in the products' dtype and T x Hv x (dv + 1) floats), then each sequence's programs carry
    the state through its chunks, a chunk's tokens together in matrix products. Without a host sync: the first
    launch's grid covers ceil(T / DELTA_CHUNK) chunks of every sequence, and those past a sequence's end return."""
    _check_layout("chunk_gated_delta_rule", x, ba, states, head_k_dim, head_v_dim)
    tokens, num_v_heads = x.shape[0], ba.shape[1] // 2
    batch = cu_seqlens.numel() - 1
    dot = delta_dot(x.dtype)
    low = torch.float32 if dot == "tf32x3" else torch.bfloat16  # what the products round their operands to
    qkw = torch.empty(tokens, num_v_heads, 3, head_k_dim, dtype=low, device=x.device)
    aqk = torch.empty(tokens, num_v_heads, DELTA_CHUNK, dtype=low, device=x.device)
    u = torch.empty(tokens, num_v_heads, head_v_dim, dtype=torch.float32, device=x.device)
    g = torch.empty(tokens, num_v_heads, dtype=torch.float32, device=x.device)
    out = torch.empty(tokens, num_v_heads, head_v_dim, dtype=x.dtype, device=x.device)
    if tokens and batch:
        block_k, block_v = _pow2(head_k_dim), min(STATE_BLOCK_V, _pow2(head_v_dim))
        shape = dict(HV=num_v_heads, DK=head_k_dim, DV=head_v_dim, BK=block_k, BV=block_v, C=DELTA_CHUNK, DOT=dot,
                     num_warps=DELTA_WARPS, **LAUNCH_OPTIONS)
        _chunk_prepare_kernel[(batch, triton.cdiv(tokens, DELTA_CHUNK), num_v_heads)](
            x, x.stride(0), ba, ba.stride(0), a_log, dt_bias, cu_seqlens, qkw, u, aqk, g,
            head_k_dim ** -0.5 if scale is None else scale, num_k_heads * head_k_dim, HK=num_k_heads, **shape)
        _chunk_gated_delta_rule_kernel[(batch * num_v_heads, triton.cdiv(head_v_dim, block_v))](
            states, states.stride(0), state_indices, cu_seqlens, has_initial_state, qkw, u, aqk, g, out, **shape)
    return out


@triton.jit
def _paged_decode_kernel(q_ptr, q_row, k_ptr, v_ptr, c_block, c_token, table_ptr, table_row, ctx_ptr, out_ptr, o_row,
                         part_ptr, split_blocks, scale, GROUP: tl.constexpr, BG: tl.constexpr, D: tl.constexpr,
                         BD: tl.constexpr, BLOCK: tl.constexpr, PARTIAL: tl.constexpr):
    """KV head `kvh` of one request: its GROUP query heads (padded to BG rows for tl.dot) over the request's blocks
    split_blocks * split .. of its context, one cache block a step with an online softmax. All in fp32 (K / V widened
    as read; the products exact, `ieee`): decode attention is bound by reading the cache, and the interpreter's tl.dot
    does not take bf16. PARTIAL: write the split's unnormalized sums and its (max, denominator) per head to part_ptr
    ([rows, Hq, splits, D + 2] fp32) for _paged_decode_reduce_kernel; else the output itself (one split)."""
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    g = tl.arange(0, BG)
    d = tl.arange(0, BD)
    t = tl.arange(0, BLOCK)
    g_ok, d_ok = g < GROUP, d < D
    q = tl.load(q_ptr + row * q_row + (kvh * GROUP + g)[:, None] * D + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    context = tl.load(ctx_ptr + row)
    m = tl.full([BG], float("-inf"), dtype=tl.float32)
    denom = tl.zeros([BG], dtype=tl.float32)
    acc = tl.zeros([BG, BD], dtype=tl.float32)
    first = split * split_blocks
    for i in range(first, tl.minimum(first + split_blocks, tl.cdiv(context, BLOCK))):
        block = tl.load(table_ptr + row * table_row + i).to(tl.int64)
        seen = i * BLOCK + t < context
        at = block * c_block + t[:, None] * c_token + kvh * D + d[None, :]
        kv_ok = seen[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + at, mask=kv_ok, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + at, mask=kv_ok, other=0.0).to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        scores = tl.where(seen[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        p = tl.exp(scores - m_new[:, None])
        rescale = tl.exp(m - m_new)
        denom = denom * rescale + tl.sum(p, 1)
        acc = acc * rescale[:, None] + tl.dot(p, v, input_precision="ieee")
        m = m_new
    heads = kvh * GROUP + g
    if PARTIAL:  # a split past the context keeps m = -inf, denominator 0: the reduction gives it no weight
        at = part_ptr + ((row * tl.num_programs(1) * GROUP + heads) * tl.num_programs(2) + split) * (D + 2)
        tl.store(at[:, None] + d[None, :], acc, mask=g_ok[:, None] & d_ok[None, :])
        tl.store(at + D, m, mask=g_ok)
        tl.store(at + D + 1, denom, mask=g_ok)
    else:
        tl.store(out_ptr + row * o_row + heads[:, None] * D + d[None, :], (acc / denom[:, None]).to(
            out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])


@triton.jit
def _paged_decode_reduce_kernel(part_ptr, out_ptr, o_row, splits, D: tl.constexpr, BD: tl.constexpr):
    """One head of one request: its splits' partial softmax sums into the output, one split at a time (each rescaled
    to the running max; split 0 holds the first block, so the max is finite from the start)."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    d = tl.arange(0, BD)
    d_ok = d < D
    at = part_ptr + (row * tl.num_programs(1) + head) * splits * (D + 2)
    m = tl.load(at + D)
    denom = tl.load(at + D + 1)
    acc = tl.load(at + d, mask=d_ok, other=0.0)
    for split in range(1, splits):
        at_split = at + split * (D + 2)
        m_split = tl.load(at_split + D)  # -inf for a split past the context: no weight
        m_new = tl.maximum(m, m_split)
        keep, add = tl.exp(m - m_new), tl.exp(m_split - m_new)
        denom = denom * keep + tl.load(at_split + D + 1) * add
        acc = acc * keep + tl.load(at_split + d, mask=d_ok, other=0.0) * add
        m = m_new
    tl.store(out_ptr + row * o_row + head * D + d, (acc / denom).to(out_ptr.dtype.element_ty), mask=d_ok)


MIN_SPLIT_BLOCKS = 8  # cache blocks a split reads at least: fewer and the partial sums' traffic outweighs the reads


def num_splits(batch: int, num_kv_heads: int, max_blocks: int, device: torch.device) -> int:
    """How many parts paged_decode cuts each context into: one where batch x kv heads programs already fill the GPU
    twice over (two per SM), else as many as make up the difference, each at least MIN_SPLIT_BLOCKS blocks: without
    them a long context at few requests reads its whole cache from a handful of SMs. Depends only on shapes (the
    block table's width, not the contexts), so a captured graph keeps it. Under the interpreter the "GPU" takes 4
    programs, so that the tests' small batches split."""
    slots = 2 * (_sm_count(device.index) if device.type == "cuda" else 2)
    programs = batch * num_kv_heads
    if programs >= slots:
        return 1
    return max(1, min(triton.cdiv(slots, programs), triton.cdiv(max_blocks, MIN_SPLIT_BLOCKS)))


@functools.lru_cache(maxsize=None)
def _sm_count(index: int | None) -> int:
    """The SMs of CUDA device `index` (None: the current one), asked once: num_splits runs per layer and step."""
    device = torch.cuda.current_device() if index is None else index
    return torch.cuda.get_device_properties(device).multi_processor_count


def supports_paged_decode(block_size: int, head_dim: int) -> bool:
    """Whether paged_decode takes this cache layout: tl.dot's operands need a block of >= 16 tokens, a power of two."""
    return block_size >= 16 and block_size & (block_size - 1) == 0 and head_dim >= 16


def paged_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                 scale: float, splits: int | None = None) -> torch.Tensor:
    """layers/attention._decode without the gather: q [Bd, Hq, D] (one token per request) over its cached blocks
    -> [Bd, Hq, D] in q's dtype, computed in fp32 (as the CPU kernel; SDPA's bf16 path rounds its probabilities).
    kv_cache [2, num_blocks, block_size, Hk, D]; block_tables [Bd, >= ceil(context / block_size)]; context_lens [Bd]
    (the new token included). Each context is read in `splits` parts (default num_splits) whose partial softmax sums a
    second launch combines."""
    batch, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    if not supports_paged_decode(block_size, head_dim) or kv_cache.stride(4) != 1 or kv_cache.stride(3) != head_dim:
        raise ValueError(f"paged_decode: block_size {block_size} must be a power of two >= 16, each token's heads "
                         "contiguous")
    q = q.contiguous()
    out = torch.empty_like(q)
    if not batch:
        return out
    max_blocks = block_tables.shape[1]
    splits = splits or num_splits(batch, num_kv_heads, max_blocks, q.device)
    split_blocks = triton.cdiv(max_blocks, splits)
    part = torch.empty(batch, num_heads, splits, head_dim + 2, dtype=torch.float32, device=q.device) if splits > 1 \
        else out
    group = num_heads // num_kv_heads
    _paged_decode_kernel[(batch, num_kv_heads, splits)](
        q, q.stride(0), kv_cache[0], kv_cache[1], kv_cache.stride(1), kv_cache.stride(2), block_tables,
        block_tables.stride(0), context_lens, out, out.stride(0), part, split_blocks, scale, GROUP=group,
        BG=_pow2(group), D=head_dim, BD=_pow2(head_dim), BLOCK=block_size, PARTIAL=splits > 1, **LAUNCH_OPTIONS)
    if splits > 1:
        _paged_decode_reduce_kernel[(batch, num_heads)](part, out, out.stride(0), splits, D=head_dim,
                                                        BD=_pow2(head_dim), **LAUNCH_OPTIONS)
    return out
