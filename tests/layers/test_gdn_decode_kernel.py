"""The fused Gated DeltaNet decode op (csrc/gdn_decode_cpu.cpp) against transformers' decode step.

The reference is transformers' own pieces, applied per step as its Qwen3_5GatedDeltaNet does at one
token: causal_conv1d_update, torch_recurrent_gated_delta_rule and Qwen3_5RMSNormGated."""

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    Qwen3_5RMSNormGated,
    causal_conv1d_update,
    torch_recurrent_gated_delta_rule,
)

from ascendserve.layers import cpu_kernels
from ascendserve.models.qwen3_5 import Qwen3_5GatedDeltaNet

WIDTH, EPS = 4, 1e-6


class Layer:
    """Random weights and state pools of one layer: Hk key heads of dk, Hv value heads of dv."""

    def __init__(self, hk, hv, dk, dv, num_slots, seed):
        gen = torch.Generator().manual_seed(seed)
        self.hk, self.hv, self.dk, self.dv = hk, hv, dk, dv
        self.channels = 2 * hk * dk + hv * dv
        self.conv_weight = torch.randn(self.channels, WIDTH, generator=gen) * 0.5
        self.a_log = torch.empty(hv).uniform_(0.01, 16, generator=gen).log()
        self.dt_bias = torch.randn(hv, generator=gen)
        self.norm_weight = 1.0 + 0.2 * torch.randn(dv, generator=gen)
        self.conv_pool = torch.randn(num_slots, self.channels, WIDTH - 1, generator=gen)
        self.ssm_pool = torch.randn(num_slots, hv, dk, dv, generator=gen) * 0.5
        self.gen = gen

    def step_inputs(self, batch):
        """qkvz [B, C + Hv*dv] and ba [B, 2*Hv], each a column slice of a wider row (as a split would be)."""
        qkvz = torch.randn(batch, self.channels + self.hv * self.dv + 3, generator=self.gen)[:, 3:]
        ba = torch.randn(batch, 2 * self.hv + 1, generator=self.gen)[:, :-1]
        return qkvz, ba

    def kernel_step(self, kernels, qkvz, ba, slots):
        return kernels.gdn_decode(qkvz, ba, self.conv_weight, self.conv_pool, self.ssm_pool, torch.tensor(slots),
                                  self.a_log, self.dt_bias, self.norm_weight, self.hk, EPS)

    def reference_step(self, qkvz, ba, slots):
        """transformers' decode step on the gathered slots; writes the new states back into the pools."""
        batch, key_dim, value_dim = qkvz.shape[0], self.hk * self.dk, self.hv * self.dv
        conv_state = self.conv_pool[slots]
        x = causal_conv1d_update(qkvz[:, :self.channels, None], conv_state, self.conv_weight, None, "silu")[..., 0]
        q, k, v = x.split([key_dim, key_dim, value_dim], dim=-1)
        b, a = ba.split([self.hv, self.hv], dim=-1)
        g = -self.a_log.exp() * F.softplus(a + self.dt_bias)
        o, ssm = torch_recurrent_gated_delta_rule(
            q.reshape(batch, 1, self.hk, self.dk), k.reshape(batch, 1, self.hk, self.dk),
            v.reshape(batch, 1, self.hv, self.dv), g[:, None], b.sigmoid()[:, None],
            initial_state=self.ssm_pool[slots].clone(), output_final_state=True, use_qk_l2norm_in_kernel=True)
        norm = Qwen3_5RMSNormGated(self.dv, eps=EPS)
        norm.weight.data.copy_(self.norm_weight)
        out = norm(o.reshape(-1, self.dv), qkvz[:, self.channels:].reshape(-1, self.dv)).reshape(batch, value_dim)
        self.conv_pool[slots], self.ssm_pool[slots] = conv_state, ssm
        return out


@pytest.mark.parametrize("hk,hv,dk,dv,slots", [
    (2, 4, 32, 16, [3]),  # one stream; grouped heads, dk != dv
    (2, 4, 16, 16, [5, 0, 2]),  # shuffled slots out of a larger pool
    (3, 3, 16, 32, [1, 2, 3, 4, 6]),
])
def test_decode_steps_match_transformers(kernels, hk, hv, dk, dv, slots):
    ours, ref = Layer(hk, hv, dk, dv, num_slots=7, seed=0), Layer(hk, hv, dk, dv, num_slots=7, seed=0)
    untouched = [s for s in range(7) if s not in slots]
    for _ in range(5):  # the conv window fills with the steps' own inputs
        qkvz, ba = ours.step_inputs(len(slots))
        ref.step_inputs(len(slots))  # same generator position
        got = ours.kernel_step(kernels, qkvz, ba, slots)
        expected = ref.reference_step(qkvz, ba, slots)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(ours.conv_pool, ref.conv_pool, atol=0, rtol=0)
        torch.testing.assert_close(ours.ssm_pool, ref.ssm_pool, atol=1e-5, rtol=1e-4)
    fresh = Layer(hk, hv, dk, dv, num_slots=7, seed=0)
    assert torch.equal(ours.ssm_pool[untouched], fresh.ssm_pool[untouched])
    assert torch.equal(ours.conv_pool[untouched], fresh.conv_pool[untouched])


def test_bad_inputs_are_errors_not_crashes(kernels):
    layer = Layer(2, 4, 16, 16, num_slots=3, seed=0)
    qkvz, ba = layer.step_inputs(2)
    with pytest.raises(RuntimeError, match="slot 3 out of range"):
        layer.kernel_step(kernels, qkvz, ba, [0, 3])
    with pytest.raises(RuntimeError, match="fp32"):
        layer.kernel_step(kernels, qkvz.bfloat16(), ba, [0, 1])
    with pytest.raises(RuntimeError, match="qkvz"):
        layer.kernel_step(kernels, qkvz[:, 1:], ba, [0, 1])


def test_layer_uses_the_op_only_for_fp32_on_cpu(kernels, monkeypatch):
    config = type("Config", (), dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                                     linear_value_head_dim=16, linear_conv_kernel_dim=WIDTH, hidden_act="silu",
                                     hidden_size=32, rms_norm_eps=EPS))
    layer = Qwen3_5GatedDeltaNet(config)
    conv, ssm = layer.state_shapes()
    state = (torch.zeros(2, *conv), torch.zeros(2, *ssm))
    assert layer._decode_kernels(torch.zeros(1, 8), state) is kernels
    assert layer._decode_kernels(torch.zeros(1, 8, dtype=torch.bfloat16), state) is None
    assert layer._decode_kernels(torch.zeros(1, 8), (state[0].bfloat16(), state[1])) is None
    monkeypatch.setitem(cpu_kernels._state, "ops", None)
    assert layer._decode_kernels(torch.zeros(1, 8), state) is None
