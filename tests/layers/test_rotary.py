"""The rotary embedding's CPU op (csrc/rope_cpu.cpp) against the torch form it replaces."""

import pytest
import torch

from ascendserve.layers import cpu_kernels
from ascendserve.layers.rotary import RotaryEmbedding, default_inv_freq


def _rotary(head_dim: int, rotary_dim: int, scaling: float = 1.0) -> RotaryEmbedding:
    return RotaryEmbedding(default_inv_freq(10000.0, rotary_dim), scaling, max_position=4096)


def _torch_form(rope, positions, q, k, monkeypatch):
    with monkeypatch.context() as m:
        m.setitem(cpu_kernels._state, "ops", None)
        return rope(positions, q, k)


@pytest.mark.parametrize("head_dim, rotary_dim, hq, hk, tokens", [
    (64, 64, 9, 3, 1),      # the demo's heads, one decode row
    (64, 64, 9, 3, 37),     # a prefill chunk
    (256, 64, 8, 2, 5),     # Qwen3.5-style partial rotary: the last 192 channels pass through
    (16, 8, 2, 2, 3),
])
def test_op_matches_the_torch_form(kernels, monkeypatch, head_dim, rotary_dim, hq, hk, tokens):
    rope = _rotary(head_dim, rotary_dim, scaling=0.9)
    gen = torch.Generator().manual_seed(0)
    fused = torch.randn(tokens, (hq + 2 * hk) * head_dim, generator=gen)
    q = fused[:, :hq * head_dim].view(tokens, hq, head_dim)  # strided views, as split out of a projection
    k = fused[:, hq * head_dim:(hq + hk) * head_dim].view(tokens, hk, head_dim)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    calls, real_op = [], kernels.rope_neox
    monkeypatch.setattr(kernels, "rope_neox", lambda *a: calls.append(1) or real_op(*a))
    got_q, got_k = rope(positions, q, k)
    assert len(calls) == 2  # q and k went through the op
    ref_q, ref_k = _torch_form(rope, positions, q, k, monkeypatch)
    torch.testing.assert_close(got_q, ref_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_k, ref_k, rtol=1e-6, atol=1e-6)
    assert got_q.is_contiguous() and got_q.shape == q.shape


def test_op_is_taken_for_fp32_and_bf16(kernels):
    rope = _rotary(32, 32)
    q, k, positions = torch.randn(2, 4, 32), torch.randn(2, 2, 32), torch.tensor([0, 5])
    assert rope._cpu_op(positions, q, k) is not None
    assert rope._cpu_op(positions, q.bfloat16(), k.bfloat16()) is not None
    assert rope._cpu_op(positions, q.half(), k.half()) is None
    assert rope._cpu_op(positions, q.bfloat16(), k) is None
    assert rope._cpu_op(positions.int(), q, k) is None


@pytest.mark.parametrize("head_dim, rotary_dim, tokens", [
    (256, 64, 7),    # Qwen3.5-style partial rotary: the channels past the rotary dim copied as they are
    (64, 64, 300),   # the demo's heads over a prefill chunk: 16 pairs at a time on AVX-512
    (48, 40, 33),    # 20 pairs: 16 on AVX-512, the last 4 one by one
])
def test_bf16_op_is_the_fp32_rotation_rounded_once(kernels, monkeypatch, head_dim, rotary_dim, tokens):
    # bf16 q computed in fp32 from the fp32 cos / sin and rounded once
    rope = _rotary(head_dim, rotary_dim, scaling=0.9)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(tokens, 4, head_dim, generator=gen).bfloat16()
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    got, _ = rope(positions, q, q[:, :2])
    assert got.dtype == torch.bfloat16
    exact, _ = _torch_form(rope, positions, q.float(), q[:, :2].float(), monkeypatch)
    assert torch.equal(got[..., rotary_dim:], q[..., rotary_dim:])
    # the fp32 result rounded once: the op's fp32 sums may differ from torch's by an ulp (an FMA), which flips the
    # rounding of a value that lies on a bf16 boundary (1 of the 76,800 values at 300 tokens, before and after the
    # AVX-512 loop): never more than one bf16 step, and rarely
    rounded = exact.bfloat16()
    torch.testing.assert_close(got.float(), rounded.float(), rtol=2.0 ** -7, atol=0)
    assert (got != rounded).sum() <= max(1, got.numel() // 10000)



def test_bad_inputs_are_errors_not_crashes(kernels):
    rope = _rotary(32, 32)
    q = torch.randn(2, 4, 32)
    with pytest.raises(RuntimeError, match="position 4096 outside"):
        kernels.rope_neox(q, torch.tensor([0, 4096]), rope.cos_cache, rope.sin_cache)
    with pytest.raises(RuntimeError, match="position -1 outside"):
        kernels.rope_neox(q, torch.tensor([-1, 0]), rope.cos_cache, rope.sin_cache)
    with pytest.raises(RuntimeError, match="positions must be"):
        kernels.rope_neox(q, torch.tensor([0]), rope.cos_cache, rope.sin_cache)
    with pytest.raises(RuntimeError, match="rotary dim"):
        kernels.rope_neox(torch.randn(2, 4, 16), torch.tensor([0, 1]), rope.cos_cache, rope.sin_cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mrope_text_positions_read_the_same_rows_as_three_equal_axes(dtype):
    # [T] positions (text only) take each slot's row directly; [3, T] ones gather per axis: equal axes, equal bits
    from ascendserve.layers.mrope import MRotaryEmbedding
    rope = MRotaryEmbedding(default_inv_freq(10000.0, 64), 1.0, 512, [11, 11, 10])
    positions = torch.tensor([0, 5, 17, 300, 511, 42])
    q, k = torch.randn(6, 4, 256).to(dtype), torch.randn(6, 2, 256).to(dtype)
    for a, b in zip(rope(positions, q, k), rope(positions.expand(3, -1), q, k)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("three_axes", [False, True])
def test_mrope_takes_the_op_and_rounds_the_fp32_rotation_once(kernels, monkeypatch, three_axes):
    # Qwen3.5's partial rotary (64 of 256 channels) on bf16 q / k strided out of a projection, through rope_neox
    from ascendserve.layers.mrope import MRotaryEmbedding
    rope = MRotaryEmbedding(default_inv_freq(10000.0, 64), 1.0, 512, [11, 11, 10])
    gen = torch.Generator().manual_seed(5)
    fused = torch.randn(6, 6 * 256, generator=gen).bfloat16()
    q, k = fused[:, :4 * 256].view(6, 4, 256), fused[:, 4 * 256:].view(6, 2, 256)
    positions = torch.randint(0, 512, (3, 6) if three_axes else (6,), generator=gen)
    calls, real_op = [], kernels.rope_neox
    monkeypatch.setattr(kernels, "rope_neox", lambda *a: calls.append(1) or real_op(*a))
    got_q, got_k = rope(positions, q, k)
    assert len(calls) == 2 and got_q.dtype == torch.bfloat16 and got_q.is_contiguous()
    exact_q, exact_k = _torch_form(rope, positions, q.float(), k.float(), monkeypatch)
    assert torch.equal(got_q, exact_q.bfloat16()) and torch.equal(got_k, exact_k.bfloat16())
    assert torch.equal(got_q[..., 64:], q[..., 64:])
