"""RMSNorm / GemmaRMSNorm: the CPU rms_norm op (csrc/rms_norm_cpu.cpp) against transformers' own norms."""

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

from ascendserve.layers import cpu_kernels
from ascendserve.layers.norm import GemmaRMSNorm, RMSNorm

EPS = 1e-6


def _pair(gemma: bool, hidden: int, seed: int = 0):
    """(ours, transformers') with the same random weight."""
    ours = GemmaRMSNorm(hidden, EPS) if gemma else RMSNorm(hidden, EPS)
    theirs = Qwen3_5RMSNorm(hidden, eps=EPS) if gemma else LlamaRMSNorm(hidden, eps=EPS)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(hidden, generator=torch.Generator().manual_seed(seed)) * 0.5)
        theirs.weight.copy_(ours.weight)
    return ours, theirs


@pytest.mark.parametrize("gemma", [False, True])
@pytest.mark.parametrize("shape", [(1, 1024), (3, 7, 64), (5, 2, 3, 256), (0, 32), (1, 1)])
def test_op_matches_transformers(kernels, gemma, shape):
    ours, theirs = _pair(gemma, shape[-1])
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1)) * 3
    out = ours(x)
    assert out.shape == x.shape and out.is_contiguous()
    torch.testing.assert_close(out, theirs(x), atol=1e-5, rtol=1e-5)


def test_op_reads_heads_split_out_of_a_fused_projection(kernels):
    # k of Qwen3.5's attention: columns 512..1023 of a [T, 2048] projection, viewed as [T, heads, 256]:
    # rows 256 apart within a token, tokens 2048 apart.
    ours, theirs = _pair(True, 256)
    fused = torch.randn(6, 2048, generator=torch.Generator().manual_seed(2))
    k = fused[:, 512:1024].view(6, 2, 256)
    assert not k.is_contiguous()
    torch.testing.assert_close(ours(k), theirs(k.contiguous()), atol=1e-5, rtol=1e-5)
    q = fused.view(6, 4, 512).chunk(2, dim=-1)[0]  # the query half of each head's [query | gate]
    torch.testing.assert_close(ours(q), theirs(q.contiguous()), atol=1e-5, rtol=1e-5)


def test_op_bad_inputs_are_errors(kernels):
    with pytest.raises(RuntimeError, match="weight must be an fp32 or bf16 \\[8\\]"):
        kernels.rms_norm(torch.zeros(2, 8), torch.zeros(4), EPS, False)
    with pytest.raises(RuntimeError, match="last one contiguous"):
        kernels.rms_norm(torch.zeros(8, 2).T, torch.zeros(8), EPS, False)
    with pytest.raises(RuntimeError, match="fp32 or bf16 tensor"):
        kernels.rms_norm(torch.zeros(2, 8, dtype=torch.float16), torch.zeros(8), EPS, False)


@pytest.mark.parametrize("gemma", [False, True])
def test_norms_use_the_op_for_fp32_and_bf16(kernels, monkeypatch, gemma):
    calls = []
    monkeypatch.setitem(cpu_kernels._state, "ops", type("Ops", (), {
        "rms_norm": staticmethod(lambda *a: calls.append(a[0].dtype) or kernels.rms_norm(*a))}))
    ours, theirs = _pair(gemma, 16)
    x = torch.randn(3, 16)
    torch.testing.assert_close(ours(x), theirs(x), atol=1e-5, rtol=1e-5)
    columns = torch.randn(16, 3).T  # last dimension strided: the torch form
    torch.testing.assert_close(ours(columns), theirs(columns), atol=1e-5, rtol=1e-5)
    ours.to(torch.bfloat16)(x.bfloat16())
    ours.half()(x.half())  # the torch form
    assert calls == [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("gemma", [False, True])
@pytest.mark.parametrize("shape", [(1, 1024), (3, 7, 64), (300, 576)])
def test_bf16_op_matches_transformers_bf16_norm(kernels, gemma, shape):
    # bf16 model: normalized in fp32 and rounded once. Qwen3.5's norm does the same (the mean summed in another
    # order); Llama's rounds x / rms(x) to bf16 before the bf16 weight's multiply rounds again.
    ours, theirs = _pair(gemma, shape[-1])
    ours.to(torch.bfloat16)
    theirs.to(torch.bfloat16)
    x = (torch.randn(*shape, generator=torch.Generator().manual_seed(4)) * 3).bfloat16()
    got, ref = ours(x), theirs(x)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    units = 1 if gemma else 2  # bf16 units (2^-7 relative at most) between the two
    assert ((got.float() - ref.float()).abs() <= units * 2.0 ** -7 * ref.float().abs() + 1e-6).all()
    if gemma:
        assert (got != ref).float().mean() < 0.02  # mostly the same value


@pytest.mark.parametrize("rows", [1, 7, 300])
def test_add_then_norm_in_one_op_matches_transformers(kernels, monkeypatch, rows):
    # A pre-norm layer's residual add and the next norm: (norm(x + residual), x + residual), the sum
    # bit for bit what x + residual gives, through the op and through the torch fallback.
    ours, theirs = _pair(False, 576)
    gen = torch.Generator().manual_seed(3)
    x, residual = torch.randn(rows, 576, generator=gen), torch.randn(rows, 576, generator=gen) * 4
    for ops in (kernels, None):
        monkeypatch.setitem(cpu_kernels._state, "ops", ops)
        normed, summed = ours(x, residual)
        assert torch.equal(summed, residual + x)
        torch.testing.assert_close(normed, theirs(residual + x), atol=1e-5, rtol=1e-5)


def test_add_rms_norm_bad_inputs_are_errors(kernels):
    weight = torch.ones(64)
    with pytest.raises(RuntimeError, match="x and residual must be contiguous fp32 or bf16"):
        kernels.add_rms_norm(torch.randn(2, 64), torch.randn(3, 64), weight, EPS, False)
    with pytest.raises(RuntimeError, match="of one shape and dtype"):
        kernels.add_rms_norm(torch.randn(2, 64), torch.randn(2, 64).bfloat16(), weight, EPS, False)
    with pytest.raises(RuntimeError, match="weight must be an fp32 or bf16"):
        kernels.add_rms_norm(torch.randn(2, 64), torch.randn(2, 64), torch.ones(32), EPS, False)


@pytest.mark.parametrize("gemma", [False, True])
def test_bf16_add_then_norm_rounds_the_sum_as_the_model_would(kernels, gemma):
    # the residual stream a bf16 model carries is x + residual rounded to bf16; the norm is taken of that
    ours, _ = _pair(gemma, 576)
    ours.to(torch.bfloat16)
    gen = torch.Generator().manual_seed(5)
    x, residual = (torch.randn(9, 576, generator=gen).bfloat16(), (torch.randn(9, 576, generator=gen) * 4).bfloat16())
    normed, summed = ours(x, residual)
    assert torch.equal(summed, residual + x)
    assert torch.equal(normed, kernels.rms_norm(residual + x, ours.weight, EPS, gemma))
