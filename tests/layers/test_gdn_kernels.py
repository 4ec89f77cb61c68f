"""The fused Gated DeltaNet ops (csrc/gdn_decode_cpu.cpp, csrc/gdn_prefill_cpu.cpp) against transformers.

The reference is transformers' own pieces, applied per sequence as its Qwen3_5GatedDeltaNet does:
causal_conv1d_update (which continues from a conv state for any number of tokens),
torch_recurrent_gated_delta_rule at one token or torch_chunk_gated_delta_rule over a prompt, and
Qwen3_5RMSNormGated."""

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    Qwen3_5RMSNormGated,
    causal_conv1d_update,
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from ascendserve.layers import cpu_kernels
from ascendserve.models.qwen3_5 import Qwen3_5GatedDeltaNet

WIDTH, EPS = 4, 1e-6


class Layer:
    """Random weights and state pools of one layer: Hk key heads of dk, Hv value heads of dv.

    decay_scale multiplies A (the per-head decay rate; transformers' init draws A from [0.01, 16]):
    0.01 keeps a long memory, so a state carried wrongly across chunks or steps shows; 100 makes
    every state underflow within a chunk, through the denormal range.
    """

    def __init__(self, hk, hv, dk, dv, num_slots, seed, decay_scale=0.01):
        gen = torch.Generator().manual_seed(seed)
        self.hk, self.hv, self.dk, self.dv = hk, hv, dk, dv
        self.channels = 2 * hk * dk + hv * dv
        self.conv_weight = torch.randn(self.channels, WIDTH, generator=gen) * 0.5
        self.a_log = (torch.empty(hv).uniform_(0.01, 16, generator=gen) * decay_scale).log()
        self.dt_bias = torch.randn(hv, generator=gen)
        self.norm_weight = 1.0 + 0.2 * torch.randn(dv, generator=gen)
        self.conv_pool = torch.randn(num_slots, self.channels, WIDTH - 1, generator=gen)
        self.ssm_pool = torch.randn(num_slots, hv, dk, dv, generator=gen) * 0.5
        self.gen = gen

    def step_inputs(self, num_tokens):
        """qkvz [T, C + Hv*dv] and ba [T, 2*Hv], each a column slice of a wider row (as a split would be)."""
        qkvz = torch.randn(num_tokens, self.channels + self.hv * self.dv + 3, generator=self.gen)[:, 3:]
        ba = torch.randn(num_tokens, 2 * self.hv + 1, generator=self.gen)[:, :-1]
        return qkvz, ba

    def params(self):
        return self.a_log, self.dt_bias, self.norm_weight, self.hk, EPS

    def kernel_decode(self, kernels, qkvz, ba, slots):
        return kernels.gdn_decode(qkvz, ba, self.conv_weight, self.conv_pool, self.ssm_pool, torch.tensor(slots),
                                  *self.params())

    def kernel_prefill(self, kernels, qkvz, ba, lengths, slots, has_initial):
        cu = torch.tensor([0, *lengths]).cumsum(0)
        return kernels.gdn_prefill(qkvz, ba, self.conv_weight, self.conv_pool, self.ssm_pool, cu, torch.tensor(slots),
                                   torch.tensor(has_initial), *self.params())

    def reference_decode(self, qkvz, ba, slots):
        """transformers' one-token step per sequence."""
        return torch.cat([self.reference_sequence(qkvz[i:i + 1], ba[i:i + 1], slot, True)
                          for i, slot in enumerate(slots)])

    def reference_prefill(self, qkvz, ba, lengths, slots, has_initial):
        bounds = torch.tensor([0, *lengths]).cumsum(0).tolist()
        return torch.cat([self.reference_sequence(qkvz[s:e], ba[s:e], slot, initial)
                          for s, e, slot, initial in zip(bounds, bounds[1:], slots, has_initial)])

    def reference_sequence(self, qkvz, ba, slot, has_initial):
        """transformers' path for one sequence of L tokens from (or, has_initial False, instead of) its slot's
        states; writes the new states back into the pools."""
        length, key_dim, value_dim = qkvz.shape[0], self.hk * self.dk, self.hv * self.dv
        conv_state = self.conv_pool[slot:slot + 1].clone() if has_initial else torch.zeros(1, self.channels, WIDTH - 1)
        x = causal_conv1d_update(qkvz[:, :self.channels].T[None], conv_state, self.conv_weight, None, "silu")[0].T
        q, k, v = x.split([key_dim, key_dim, value_dim], dim=-1)
        b, a = ba.split([self.hv, self.hv], dim=-1)
        g = -self.a_log.exp() * F.softplus(a + self.dt_bias)
        inputs = (q.reshape(1, length, self.hk, self.dk), k.reshape(1, length, self.hk, self.dk),
                  v.reshape(1, length, self.hv, self.dv), g[None], b.sigmoid()[None])
        initial = self.ssm_pool[slot:slot + 1].clone() if has_initial else torch.zeros(1, self.hv, self.dk, self.dv)
        rule = torch_recurrent_gated_delta_rule if length == 1 else torch_chunk_gated_delta_rule
        o, ssm = rule(*inputs, initial_state=initial, output_final_state=True, use_qk_l2norm_in_kernel=True)
        norm = Qwen3_5RMSNormGated(self.dv, eps=EPS)
        norm.weight.data.copy_(self.norm_weight)
        out = norm(o.reshape(-1, self.dv), qkvz[:, self.channels:].reshape(-1, self.dv)).reshape(length, value_dim)
        self.conv_pool[slot], self.ssm_pool[slot] = conv_state[0], ssm[0]
        return out


def assert_same_layer_state(ours: Layer, ref: Layer):
    torch.testing.assert_close(ours.conv_pool, ref.conv_pool, atol=0, rtol=0)
    torch.testing.assert_close(ours.ssm_pool, ref.ssm_pool, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("hk,hv,dk,dv,slots", [
    (2, 4, 32, 16, [3]),  # one stream; grouped heads, dk != dv
    (2, 4, 16, 16, [5, 0, 2]),  # shuffled slots out of a larger pool
    (3, 3, 16, 32, [1, 2, 3, 4, 6]),
    (1, 1, 8, 8, [2, 4]),  # 24 conv channels: 16 in the vector conv step, 8 in the scalar tail
    (4, 8, 64, 96, [0, 6]),  # 1280 conv channels: two runs of the conv loop
])
def test_decode_steps_match_transformers(kernels, hk, hv, dk, dv, slots):
    ours, ref = Layer(hk, hv, dk, dv, num_slots=7, seed=0), Layer(hk, hv, dk, dv, num_slots=7, seed=0)
    untouched = [s for s in range(7) if s not in slots]
    for _ in range(5):  # the conv window fills with the steps' own inputs
        qkvz, ba = ours.step_inputs(len(slots))
        ref.step_inputs(len(slots))  # same generator position
        got = ours.kernel_decode(kernels, qkvz, ba, slots)
        expected = ref.reference_decode(qkvz, ba, slots)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
        assert_same_layer_state(ours, ref)
    fresh = Layer(hk, hv, dk, dv, num_slots=7, seed=0)
    assert torch.equal(ours.ssm_pool[untouched], fresh.ssm_pool[untouched])
    assert torch.equal(ours.conv_pool[untouched], fresh.conv_pool[untouched])


# dv: the state is walked in blocks of 32 value columns; 16 is one short block, 32 one full block, 40 a
# full block and a tail of 8; dk 33 leaves a row after the unrolled groups of 4.
@pytest.mark.parametrize("hk,hv,dk,dv", [(2, 4, 32, 16), (3, 3, 16, 32), (1, 2, 33, 40)])
@pytest.mark.parametrize("decay_scale", [0.01, 100.0])
def test_prefill_matches_transformers(kernels, hk, hv, dk, dv, decay_scale):
    # Lengths below the conv width, around transformers' 64-token chunk and past the op's 256-token
    # segment; fresh and continuing sequences, whose slots are shuffled and one slot (4) is nobody's.
    lengths, slots = [1, 2, 64, 65, 300, 7], [5, 0, 2, 6, 1, 3]
    has_initial = [False, True, True, False, True, False]
    ours, ref = (Layer(hk, hv, dk, dv, num_slots=7, seed=0, decay_scale=decay_scale) for _ in range(2))
    qkvz, ba = ours.step_inputs(sum(lengths))
    got = ours.kernel_prefill(kernels, qkvz, ba, lengths, slots, has_initial)
    expected = ref.reference_prefill(qkvz, ba, lengths, slots, has_initial)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert_same_layer_state(ours, ref)
    fresh = Layer(hk, hv, dk, dv, num_slots=7, seed=0, decay_scale=decay_scale)
    assert torch.equal(ours.ssm_pool[4], fresh.ssm_pool[4]) and torch.equal(ours.conv_pool[4], fresh.conv_pool[4])


@pytest.mark.parametrize("pieces", [[16, 48, 100], [1, 2, 70], [64, 64]])
def test_prefill_in_pieces_then_decode_equals_one_prompt(kernels, pieces):
    ours, ref = Layer(2, 4, 32, 16, num_slots=3, seed=1), Layer(2, 4, 32, 16, num_slots=3, seed=1)
    qkvz, ba = ours.step_inputs(sum(pieces) + 3)
    got, start = [], 0
    for i, n in enumerate(pieces):  # chunked prefill: every piece after the first continues the slot
        got.append(ours.kernel_prefill(kernels, qkvz[start:start + n], ba[start:start + n], [n], [2], [i > 0]))
        start += n
    expected = [ref.reference_prefill(qkvz[:start], ba[:start], [start], [2], [False])]
    for t in range(start, start + 3):
        got.append(ours.kernel_decode(kernels, qkvz[t:t + 1], ba[t:t + 1], [2]))
        expected.append(ref.reference_decode(qkvz[t:t + 1], ba[t:t + 1], [2]))
    torch.testing.assert_close(torch.cat(got), torch.cat(expected), atol=1e-4, rtol=1e-4)
    assert_same_layer_state(ours, ref)


def bf16_state_pair(hk, hv, dk, dv, num_slots, seed):
    """A layer with a bf16 recurrent pool (--mamba-ssm-cache-dtype bfloat16) and its twin with an fp32 pool holding
    the same values."""
    ours, twin = Layer(hk, hv, dk, dv, num_slots, seed), Layer(hk, hv, dk, dv, num_slots, seed)
    ours.ssm_pool = ours.ssm_pool.bfloat16()
    twin.ssm_pool = ours.ssm_pool.float()
    return ours, twin


# decode's bf16 head walks 128 / 64 / 16 columns at a time (dv 128: Qwen3.5's; 80: 64 + 16; 16), other dv the portable
# loops (40; in prefill a 32-column block and a tail of 8)
@pytest.mark.parametrize("hk,hv,dk,dv,slots", [(2, 4, 32, 16, [3]), (2, 4, 16, 40, [5, 0, 2]), (1, 2, 32, 128, [1, 6]),
                                               (1, 1, 16, 80, [0])])
def test_decode_on_a_bf16_state_pool_rounds_the_fp32_step_once(kernels, hk, hv, dk, dv, slots):
    ours, twin = bf16_state_pair(hk, hv, dk, dv, num_slots=7, seed=0)
    start = ours.ssm_pool.clone()
    for _ in range(4):
        qkvz, ba = ours.step_inputs(len(slots))
        twin.step_inputs(len(slots))
        got = ours.kernel_decode(kernels, qkvz, ba, slots)
        expected = twin.kernel_decode(kernels, qkvz, ba, slots)  # the fp32 op from the same state values
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)
        assert ours.ssm_pool.dtype == torch.bfloat16
        assert torch.equal(ours.ssm_pool, twin.ssm_pool.bfloat16())  # rounded to nearest even, once a step
        assert torch.equal(ours.conv_pool, twin.conv_pool)
        twin.ssm_pool = ours.ssm_pool.float()  # the twin goes on from the rounded state
    untouched = [s for s in range(7) if s not in slots]
    assert torch.equal(ours.ssm_pool[untouched], start[untouched])


def test_bf16_state_decode_stays_near_transformers_fp32(kernels):
    # Rounding the state every step drifts from fp32 state, but slowly: 12 steps from a random state.
    ours, _ = bf16_state_pair(2, 4, 32, 16, num_slots=3, seed=4)
    ref = Layer(2, 4, 32, 16, num_slots=3, seed=4)
    ref.ssm_pool = ours.ssm_pool.float()
    for _ in range(12):
        qkvz, ba = ours.step_inputs(2)
        ref.step_inputs(2)
        got = ours.kernel_decode(kernels, qkvz, ba, [2, 0])
        torch.testing.assert_close(got, ref.reference_decode(qkvz, ba, [2, 0]), atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(ours.ssm_pool.float(), ref.ssm_pool, atol=3e-2, rtol=3e-2)


def test_prefill_on_a_bf16_state_pool(kernels):
    # Within one 256-token segment the op keeps the state block in fp32: a prompt of up to 256 tokens gives the fp32
    # op's outputs and its final state rounded once. The 300-token prompt rounds at its segment boundary too.
    lengths, slots, has_initial = [1, 64, 200, 300], [4, 0, 2, 5], [True, False, True, True]
    ours, twin = bf16_state_pair(2, 4, 16, 40, num_slots=6, seed=2)
    start = ours.ssm_pool.clone()
    qkvz, ba = ours.step_inputs(sum(lengths))
    got = ours.kernel_prefill(kernels, qkvz, ba, lengths, slots, has_initial)
    expected = twin.kernel_prefill(kernels, qkvz, ba, lengths, slots, has_initial)
    short = sum(lengths[:3])
    torch.testing.assert_close(got[:short], expected[:short], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got[short:], expected[short:], atol=2e-2, rtol=2e-2)
    assert torch.equal(ours.ssm_pool[slots[:3]], twin.ssm_pool[slots[:3]].bfloat16())
    torch.testing.assert_close(ours.ssm_pool[5].float(), twin.ssm_pool[5], atol=2e-2, rtol=2e-2)
    assert torch.equal(ours.conv_pool, twin.conv_pool)
    assert torch.equal(ours.ssm_pool[[1, 3]], start[[1, 3]])  # nobody's slots


@pytest.mark.parametrize("hk,hv,dk,dv", [(2, 4, 32, 16), (1, 2, 33, 40)])
def test_prefill_takes_bf16_projections_as_their_fp32_values(kernels, hk, hv, dk, dv):
    # A bf16 model's qkvz and ba go in as they are: the op widens them (exactly) where it reads them, so outputs and
    # both pools equal the op's on qkvz.float() and ba.float(); sequences shorter than the conv's window, fresh and
    # continuing ones, and one past the 256-token segment.
    lengths, slots, has_initial = [1, 2, 65, 300], [3, 0, 2, 1], [True, False, True, False]
    ours, twin = Layer(hk, hv, dk, dv, num_slots=4, seed=3), Layer(hk, hv, dk, dv, num_slots=4, seed=3)
    qkvz, ba = ours.step_inputs(sum(lengths))
    qkvz, ba = qkvz.bfloat16(), ba.bfloat16()
    got = ours.kernel_prefill(kernels, qkvz, ba, lengths, slots, has_initial)
    expected = twin.kernel_prefill(kernels, qkvz.float(), ba.float(), lengths, slots, has_initial)
    assert got.dtype == torch.float32 and torch.equal(got, expected)
    assert torch.equal(ours.conv_pool, twin.conv_pool) and torch.equal(ours.ssm_pool, twin.ssm_pool)


def test_bad_inputs_are_errors_not_crashes(kernels):
    layer = Layer(2, 4, 16, 16, num_slots=3, seed=0)
    qkvz, ba = layer.step_inputs(2)
    with pytest.raises(RuntimeError, match="slot 3 out of range"):
        layer.kernel_decode(kernels, qkvz, ba, [0, 3])
    with pytest.raises(RuntimeError, match="fp32"):
        layer.kernel_decode(kernels, qkvz.bfloat16(), ba, [0, 1])
    layer.ssm_pool = layer.ssm_pool.half()
    with pytest.raises(RuntimeError, match="recurrent-state pool must be fp32 or bf16"):
        layer.kernel_decode(kernels, qkvz, ba, [0, 1])
    layer.ssm_pool = layer.ssm_pool.float()
    with pytest.raises(RuntimeError, match="qkvz"):
        layer.kernel_decode(kernels, qkvz[:, 1:], ba, [0, 1])
    with pytest.raises(RuntimeError, match="slot -1 out of range"):
        layer.kernel_prefill(kernels, qkvz, ba, [2], [-1], [False])
    with pytest.raises(RuntimeError, match="cu_seqlens must run from 0 to T"):
        layer.kernel_prefill(kernels, qkvz, ba, [1], [0], [False])
    with pytest.raises(RuntimeError, match="cu_seqlens must not decrease"):
        layer.kernel_prefill(kernels, qkvz, ba, [3, -1], [0, 1], [False, False])
    with pytest.raises(RuntimeError, match="qkvz and ba must be both fp32 or both bf16"):
        layer.kernel_prefill(kernels, qkvz.bfloat16(), ba, [2], [0], [False])
    with pytest.raises(RuntimeError, match="qkvz and ba must be both fp32 or both bf16"):
        layer.kernel_prefill(kernels, qkvz.half(), ba.half(), [2], [0], [False])


def test_layer_uses_the_op_for_fp32_and_bf16_on_cpu_with_fp32_or_bf16_state(kernels, monkeypatch):
    config = type("Config", (), dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                                     linear_value_head_dim=16, linear_conv_kernel_dim=WIDTH, hidden_act="silu",
                                     hidden_size=32, rms_norm_eps=EPS))
    layer = Qwen3_5GatedDeltaNet(config)
    conv, ssm = layer.state_shapes()
    state = (torch.zeros(2, *conv), torch.zeros(2, *ssm))
    assert layer._cpu_kernels(torch.zeros(1, 8), state) is kernels
    assert layer._cpu_kernels(torch.zeros(1, 8, dtype=torch.bfloat16), state) is kernels  # a bf16 model, widened
    assert layer._cpu_kernels(torch.zeros(1, 8, dtype=torch.float16), state) is None
    assert layer._cpu_kernels(torch.zeros(1, 8), (state[0].bfloat16(), state[1])) is None
    assert layer._cpu_kernels(torch.zeros(1, 8), (state[0], state[1].bfloat16())) is kernels  # bf16 recurrent state
    assert layer._cpu_kernels(torch.zeros(1, 8), (state[0], state[1].half())) is None
    # a bf16 layer hands the ops fp32 copies of its parameters, made once
    layer.to(torch.bfloat16)
    params = layer._fp32_params()
    assert all(p.dtype == torch.float32 and p.is_contiguous() for p in params) and params is layer._fp32_params()
    assert torch.equal(params[1], layer.A_log.float()) and params[0].shape == (layer.conv_dim, WIDTH)
    monkeypatch.setitem(cpu_kernels._state, "ops", None)
    assert layer._cpu_kernels(torch.zeros(1, 8), state) is None
