"""Gated DeltaNet kernels vs transformers' torch reference and vs themselves (packing, chunking)."""

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from ascendserve.layers.gated_deltanet import (
    causal_conv1d_decode,
    causal_conv1d_prefill,
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)

HK, HV, DK, DV = 2, 4, 32, 16  # grouped heads and dk != dv, to catch head/transpose mix-ups
TOL = dict(atol=1e-4, rtol=1e-4)


def gdn_inputs(num_tokens: int, seed: int = 0, dtype=torch.float32):
    """q, k [T, HK, DK], v [T, HV, DV], g, beta [T, HV] shaped like Qwen3.5's (q, k not normalized)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(num_tokens, HK, DK, generator=gen)
    k = torch.randn(num_tokens, HK, DK, generator=gen)
    v = torch.randn(num_tokens, HV, DV, generator=gen)
    a_log = torch.empty(HV).uniform_(0.01, 16, generator=gen).log()
    dt_bias = torch.ones(HV)
    a = torch.randn(num_tokens, HV, generator=gen) - 2.0  # mostly mild decays, some strong
    g = -a_log.exp() * F.softplus(a + dt_bias)
    beta = torch.randn(num_tokens, HV, generator=gen).sigmoid()
    return [x.to(dtype) for x in (q, k, v)] + [g, beta.to(dtype)]


def random_states(batch: int, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, HV, DK, DV, generator=gen) * 0.5


def cu(lengths) -> torch.Tensor:
    return torch.tensor([0] + lengths).cumsum(0)


def ours_chunk(q, k, v, g, beta, initial_states, lengths, **kw):
    return chunk_gated_delta_rule(q, k, v, g, beta, initial_states, cu(lengths), use_qk_l2norm_in_kernel=True, **kw)


def hf_chunk(q, k, v, g, beta, initial_state):
    o, s = torch_chunk_gated_delta_rule(
        *(x.unsqueeze(0) for x in (q, k, v, g, beta)),
        initial_state=initial_state,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    return o[0], s


# ---- delta rule -----------------------------------------------------------------------------------


@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("length", [1, 5, 63, 64, 65, 130, 300])
def test_chunk_matches_transformers(length, with_state):
    inputs = gdn_inputs(length, seed=length)
    init = random_states(1) if with_state else None
    o, s = ours_chunk(*inputs, init, [length])
    o_ref, s_ref = hf_chunk(*inputs, init)
    assert o.shape == (length, HV, DV) and s.shape == (1, HV, DK, DV) and s.dtype == torch.float32
    torch.testing.assert_close(o, o_ref, **TOL)
    torch.testing.assert_close(s, s_ref, **TOL)


def test_recurrent_matches_transformers():
    steps, slots = 6, [4, 0, 2]
    seqs = [gdn_inputs(steps, seed=10 + i) for i in range(len(slots))]
    init = random_states(len(slots))
    pool = torch.full((6, HV, DK, DV), 7.0)
    pool[slots] = init
    outs = []
    for t in range(steps):
        step = [torch.stack([seq[j][t] for seq in seqs]) for j in range(5)]
        outs.append(recurrent_gated_delta_rule(*step, pool, torch.tensor(slots), use_qk_l2norm_in_kernel=True))
    batched = [torch.stack(xs) for xs in zip(*seqs)]  # [B, T, ...]
    o_ref, s_ref = torch_recurrent_gated_delta_rule(
        *batched, initial_state=init.clone(), output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    torch.testing.assert_close(torch.stack(outs, 1), o_ref, **TOL)
    torch.testing.assert_close(pool[slots], s_ref, **TOL)
    untouched = [i for i in range(6) if i not in slots]
    assert (pool[untouched] == 7.0).all()


@pytest.mark.parametrize("slots", [[1, 2, 3], [3, 1, 2], [5, 4]])
def test_recurrent_in_place_on_a_slot_block_equals_the_gathered_path(slots):
    step = [torch.stack(xs) for xs in zip(*(
        [x[0] for x in gdn_inputs(1, seed=20 + i)] for i in range(len(slots))))]
    pool = random_states(6)
    expected_pool = pool.clone()
    idx = torch.tensor(slots)
    expected = recurrent_gated_delta_rule(*step, expected_pool, idx, use_qk_l2norm_in_kernel=True)
    first = min(slots)
    order = sorted(range(len(slots)), key=slots.__getitem__)
    block = (first, None if order == sorted(order) else torch.tensor(order))
    got = recurrent_gated_delta_rule(*step, pool, idx, slot_block=block, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(got, expected, **TOL)
    torch.testing.assert_close(pool, expected_pool, **TOL)


@pytest.mark.parametrize("decay_scale", [1.0, 0.01])  # 0.01: near-1 decays, a long memory
def test_chunk_matches_token_by_token_recurrent(decay_scale):
    length = 150
    q, k, v, g, beta = gdn_inputs(length, seed=3)
    g = g * decay_scale
    init = random_states(1)
    o, s = ours_chunk(q, k, v, g, beta, init, [length])
    pool = init.clone()
    idx = torch.tensor([0])
    steps = [
        recurrent_gated_delta_rule(
            q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1], pool, idx,
            use_qk_l2norm_in_kernel=True,
        )
        for t in range(length)
    ]
    torch.testing.assert_close(o, torch.cat(steps), **TOL)
    torch.testing.assert_close(s, pool, **TOL)


@pytest.mark.parametrize("lengths", [[1, 70, 3, 129], [64, 1, 128, 0, 5]])
def test_packed_batch_equals_each_sequence_alone(lengths):
    inputs = gdn_inputs(sum(lengths), seed=5)
    init = random_states(len(lengths))
    o, s = ours_chunk(*inputs, init, lengths)
    bounds = cu(lengths).tolist()
    for b, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        o_b, s_b = ours_chunk(*(x[start:end] for x in inputs), init[b : b + 1], [end - start])
        torch.testing.assert_close(o[start:end], o_b, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(s[b : b + 1], s_b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pieces", [[16, 48, 100], [100, 1, 63], [1, 1, 200]])
def test_chunked_prefill_continuation(pieces):
    inputs = gdn_inputs(sum(pieces), seed=7)
    o_whole, s_whole = ours_chunk(*inputs, None, [sum(pieces)])
    state, outs, start = None, [], 0
    for n in pieces:
        o, state = ours_chunk(*(x[start : start + n] for x in inputs), state, [n])
        outs.append(o)
        start += n
    torch.testing.assert_close(torch.cat(outs), o_whole, **TOL)
    torch.testing.assert_close(state, s_whole, **TOL)


def test_prescaled_inputs_with_explicit_scale():
    """Normalizing and scaling outside the kernel (scale=1.0) equals doing it inside."""
    q, k, v, g, beta = gdn_inputs(40, seed=8)
    o_in, s_in = ours_chunk(q, k, v, g, beta, None, [40])
    q_out = F.normalize(q, dim=-1, eps=0) * DK**-0.5
    o_out, s_out = chunk_gated_delta_rule(
        q_out, F.normalize(k, dim=-1, eps=0), v, g, beta, None, cu([40]), scale=1.0
    )
    torch.testing.assert_close(o_out, o_in, atol=1e-4, rtol=1e-3)
    torch.testing.assert_close(s_out, s_in, atol=1e-4, rtol=1e-3)


def test_bf16_inputs_keep_fp32_state():
    q, k, v, g, beta = gdn_inputs(90, seed=9, dtype=torch.bfloat16)
    init = random_states(1)
    o, s = ours_chunk(q, k, v, g, beta, init, [90])
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    o32, s32 = ours_chunk(q.float(), k.float(), v.float(), g, beta.float(), init, [90])
    torch.testing.assert_close(s, s32, **TOL)
    torch.testing.assert_close(o, o32.to(torch.bfloat16))

    pool = torch.zeros(2, HV, DK, DV)
    pool[1] = s32[0]
    step = gdn_inputs(1, seed=11, dtype=torch.bfloat16)
    o1 = recurrent_gated_delta_rule(*step, pool, torch.tensor([1]), use_qk_l2norm_in_kernel=True)
    assert o1.dtype == torch.bfloat16 and pool.dtype == torch.float32
    o1_ref, s1_ref = hf_chunk(*(x.float() for x in step), s32)
    torch.testing.assert_close(pool[1:], s1_ref, **TOL)
    torch.testing.assert_close(o1, o1_ref.to(torch.bfloat16))


@pytest.mark.parametrize("slot_block", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_recurrent_on_a_half_precision_pool_rounds_the_fp32_step_once(slot_block, dtype):
    # --mamba-ssm-cache-dtype bfloat16 / float16: the step reads the pool's values, computes in fp32 and stores the
    # new state rounded once, so it equals the fp32 step from the same (exactly representable) values, rounded.
    slots = [1, 2, 3]
    step = [torch.stack(xs) for xs in zip(*([x[0] for x in gdn_inputs(1, seed=30 + i)] for i in range(3)))]
    pool = random_states(5).to(dtype)
    pool32 = pool.float()
    block = (1, None) if slot_block else None
    got = recurrent_gated_delta_rule(*step, pool, torch.tensor(slots), slot_block=block, use_qk_l2norm_in_kernel=True)
    expected = recurrent_gated_delta_rule(*step, pool32, torch.tensor(slots), use_qk_l2norm_in_kernel=True)
    assert pool.dtype == dtype
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
    assert torch.equal(pool, pool32.to(dtype))
    assert not torch.equal(pool[slots].float(), random_states(5).to(dtype)[slots].float())  # the step did write


# ---- causal conv1d --------------------------------------------------------------------------------

C, K = 6, 4


def conv_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """SiLU(conv1d) with K-1 zeros of left padding over one whole sequence x [L, C]."""
    y = F.conv1d(x.t().unsqueeze(0), weight.unsqueeze(1), padding=K - 1, groups=C)[0, :, : x.shape[0]]
    return F.silu(y.t())


def last_inputs(x: torch.Tensor) -> torch.Tensor:
    """The expected conv state [C, K-1]: last K-1 inputs, zero-padded on the left."""
    return F.pad(x.t(), (K - 1, 0))[:, -(K - 1) :]


def conv_weight(seed: int = 0) -> torch.Tensor:
    return torch.randn(C, K, generator=torch.Generator().manual_seed(seed))


def test_conv_prefill_fresh_sequences_including_short_ones():
    lengths, slots = [1, 2, 3, 4, 10, 37], [5, 0, 3, 1, 7, 2]
    weight = conv_weight()
    x = torch.randn(sum(lengths), C)
    pool = torch.full((8, C, K - 1), float("nan"))  # garbage in fresh slots must be ignored
    y = causal_conv1d_prefill(
        x, weight, pool, cu(lengths), torch.tensor(slots), torch.zeros(len(lengths), dtype=torch.bool)
    )
    bounds = cu(lengths).tolist()
    for b, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        torch.testing.assert_close(y[start:end], conv_reference(x[start:end], weight))
        torch.testing.assert_close(pool[slots[b]], last_inputs(x[start:end]))
    assert pool[[4, 6]].isnan().all()


@pytest.mark.parametrize("pieces", [[1, 2, 30, 7], [2, 1, 1, 1, 5], [16, 48, 100]])
def test_conv_prefill_continuation(pieces):
    weight = conv_weight(1)
    x = torch.randn(sum(pieces), C)
    pool = torch.full((3, C, K - 1), float("nan"))
    slot = torch.tensor([2])
    outs, start = [], 0
    for i, n in enumerate(pieces):
        has_state = torch.tensor([i > 0])
        outs.append(causal_conv1d_prefill(x[start : start + n], weight, pool, cu([n]), slot, has_state))
        start += n
    torch.testing.assert_close(torch.cat(outs), conv_reference(x, weight))
    torch.testing.assert_close(pool[2], last_inputs(x))


def test_conv_mixed_batch_then_decode():
    """One batch mixing a continuing and a fresh sequence, then decode steps for both."""
    weight = conv_weight(2)
    xa, xb = torch.randn(30, C), torch.randn(20, C)
    pool = torch.full((4, C, K - 1), float("nan"))
    causal_conv1d_prefill(xa[:2], weight, pool, cu([2]), torch.tensor([3]), torch.tensor([False]))
    y = causal_conv1d_prefill(
        torch.cat([xa[2:25], xb[:2]]), weight, pool, cu([23, 2]), torch.tensor([3, 1]), torch.tensor([True, False])
    )
    ya, yb = conv_reference(xa, weight), conv_reference(xb, weight)
    torch.testing.assert_close(y, torch.cat([ya[2:25], yb[:2]]))
    for t in range(5):
        step = torch.stack([xa[25 + t], xb[2 + t]])
        y = causal_conv1d_decode(step, weight, pool, torch.tensor([3, 1]))
        torch.testing.assert_close(y, torch.stack([ya[25 + t], yb[2 + t]]))
    torch.testing.assert_close(pool[3], last_inputs(xa))
    torch.testing.assert_close(pool[1], last_inputs(xb[:7]))


def test_conv_bf16():
    weight = conv_weight(3).to(torch.bfloat16)
    x = torch.randn(9, C).to(torch.bfloat16)
    pool = torch.zeros(1, C, K - 1, dtype=torch.bfloat16)
    y = causal_conv1d_prefill(x[:8], weight, pool, cu([8]), torch.tensor([0]), torch.tensor([False]))
    y_last = causal_conv1d_decode(x[8:], weight, pool, torch.tensor([0]))
    assert y.dtype == y_last.dtype == torch.bfloat16
    ref = conv_reference(x.float(), weight.float())
    torch.testing.assert_close(torch.cat([y, y_last]).float(), ref, atol=3e-2, rtol=2e-2)


def test_conv_prefill_bias_and_no_activation():
    weight, bias = conv_weight(4), torch.randn(C, generator=torch.Generator().manual_seed(5))
    x = torch.randn(11, C)
    pool = torch.zeros(1, C, K - 1)
    y = causal_conv1d_prefill(x, weight, pool, cu([11]), torch.tensor([0]), torch.tensor([False]), bias=bias,
                              activation=None)
    ref = F.conv1d(x.t().unsqueeze(0), weight.unsqueeze(1), bias, padding=K - 1, groups=C)[0, :, :11].t()
    torch.testing.assert_close(y, ref)
