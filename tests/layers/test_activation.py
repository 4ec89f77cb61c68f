"""GatedActivation: the CPU silu_and_mul op (csrc/silu_and_mul_cpu.cpp) against the torch form."""

import pytest
import torch
import torch.nn.functional as F

from ascendserve.layers import cpu_kernels
from ascendserve.layers.activation import GatedActivation


def torch_form(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.mark.parametrize("shape", [(1, 7168), (3, 5, 64), (0, 8), (70, 2)])
def test_silu_and_mul_matches_torch(kernels, shape):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0)) * 4
    got = kernels.silu_and_mul(x)
    assert got.shape == (*shape[:-1], shape[-1] // 2)
    torch.testing.assert_close(got, torch_form(x), atol=1e-6, rtol=1e-5)


def test_silu_and_mul_reads_strided_rows(kernels):
    wide = torch.randn(6, 40, generator=torch.Generator().manual_seed(1))
    x = wide[:, 4:36]  # rows 40 apart, columns contiguous: a split of a fused projection
    torch.testing.assert_close(kernels.silu_and_mul(x), torch_form(x), atol=1e-6, rtol=1e-5)


def test_silu_and_mul_bad_inputs_are_errors(kernels):
    with pytest.raises(RuntimeError, match="must be even"):
        kernels.silu_and_mul(torch.zeros(2, 5))
    with pytest.raises(RuntimeError, match="fp32 or bf16 expected"):
        kernels.silu_and_mul(torch.zeros(2, 4, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="contiguous"):
        kernels.silu_and_mul(torch.zeros(4, 2).T)


def test_silu_and_mul_in_bf16_is_the_fp32_result_rounded_once(kernels):
    x = (torch.randn(5, 3584, generator=torch.Generator().manual_seed(2)) * 4).bfloat16()
    got = kernels.silu_and_mul(x)
    assert got.dtype == torch.bfloat16 and got.shape == (5, 1792)
    once = torch_form(x.float()).bfloat16()  # torch's fp32 result rounded once
    # the same bf16 value but where the two fp32 results straddle a rounding boundary (exp's last bits): a unit apart
    assert (got != once).float().mean() < 0.01
    assert ((got.float() - once.float()).abs() <= 2.0 ** -7 * once.float().abs()).all()


def test_gated_activation_uses_the_op_for_fp32_and_bf16_silu(kernels, monkeypatch):
    calls = []
    monkeypatch.setitem(cpu_kernels._state, "ops", type("Ops", (), {
        "silu_and_mul": staticmethod(lambda x: calls.append(x.dtype) or kernels.silu_and_mul(x))}))
    x = torch.randn(3, 16)
    torch.testing.assert_close(GatedActivation("silu")(x), torch_form(x))
    torch.testing.assert_close(GatedActivation("silu")(x.bfloat16()), torch_form(x.bfloat16()), atol=0, rtol=2 ** -7)
    GatedActivation("silu")(x.half())  # the torch form
    GatedActivation("gelu")(x)
    assert calls == [torch.float32, torch.bfloat16]
