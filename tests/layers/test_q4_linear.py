"""Q4Linear: weights on a 4-bit grid (dequantized Q4_0 / Q4_1) kept as 4-bit, multiplied in fp32 by the C++ kernel."""

import gguf
import numpy as np
import pytest
import torch
from torch import nn

from ascendserve.layers import linear as linear_mod
from ascendserve.layers.linear import Bf16Linear, Q4Linear, find_q4_grid, pack_q4, prepack_linears_
from tests.layers.kernel_checks import (assert_fp32_product, assert_kernel_rows, assert_kernel_up_to_max_rows,
                                       fp32_layer_type)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _gguf_dequantized(n: int, k: int, qtype: gguf.GGMLQuantizationType, seed: int = 0) -> torch.Tensor:
    """A random [N, K] weight through llama.cpp's own quantize / dequantize (the gguf package's reference)."""
    rng = np.random.default_rng(seed)
    weight = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(weight, qtype), qtype).reshape(n, k).copy())


def _grid_linear(n: int, k: int, bias: bool, qtype=gguf.GGMLQuantizationType.Q4_1, seed: int = 0) -> nn.Linear:
    layer = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(_gguf_dequantized(n, k, qtype, seed))
    return layer


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1])
def test_grid_of_a_dequantized_gguf_is_found_exactly(qtype):
    weight = _gguf_dequantized(96, 576, qtype)
    q, d, m = find_q4_grid(weight)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15 and d.shape == m.shape == (96, 576 // 32)
    rebuilt = (q.float().view(96, -1, 32) * d[..., None] + m[..., None]).reshape(96, 576)
    assert torch.equal(rebuilt, weight)


def test_weights_off_the_grid_are_not_taken():
    assert find_q4_grid(torch.randn(64, 64)) is None
    assert find_q4_grid(torch.randn(64, 48)) is None  # K not a multiple of 32
    weight = _gguf_dequantized(64, 64, gguf.GGMLQuantizationType.Q4_1)
    weight[63, 5] += 1e-3  # one value off the grid of its block
    assert find_q4_grid(weight) is None


SHAPES = [(1, 32), (37, 64), (64, 576), (200, 1536)]  # (N, K): N around the 32-row panel
ROWS = [1, 2, 5, 6, 7, 13, 64, 65, 128, 129, 300]  # around the 6-row tile, the row chunk, the kernel limit


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("op", ["q4_linear", "q4_linear_portable"])
def test_kernel_is_the_fp32_product_of_the_grid_weight(kernels, n, k, bias, op):
    layer = _grid_linear(n, k, bias)
    assert_kernel_rows(getattr(kernels, op), pack_q4(*find_q4_grid(layer.weight.detach())), layer, ROWS)


def test_layer_runs_its_fp32_layer_above_the_kernel_rows(kernels, monkeypatch):
    layer = _grid_linear(96, 576, True)
    q4 = Q4Linear(layer, find_q4_grid(layer.weight.detach()), kernels)
    assert_kernel_up_to_max_rows(q4, layer, linear_mod.Q4_KERNEL_MAX_ROWS, monkeypatch)
    assert q4.q.numel() == 96 * 576 // 2 and q4.bias is layer.bias  # half a byte per weight, plus d and m per 32


def test_kernel_rejects_mismatched_inputs(kernels):
    packed = pack_q4(*find_q4_grid(_gguf_dequantized(40, 64, gguf.GGMLQuantizationType.Q4_1)))
    with pytest.raises(RuntimeError, match="x has 32 columns, the weight 64"):
        kernels.q4_linear(torch.randn(3, 32), *packed, 40, None)
    with pytest.raises(RuntimeError, match="n=70 does not match 2 panels"):
        kernels.q4_linear(torch.randn(3, 64), *packed, 70, None)
    q, scales, mins = packed
    with pytest.raises(RuntimeError, match="K=64 is not 3 blocks of an even size"):
        kernels.q4_unpack(q, scales.new_zeros(2, 3, 32), mins.new_zeros(2, 3, 32), 40)
    with pytest.raises(RuntimeError, match="scales and mins must be"):
        kernels.q4_unpack(q, scales, mins[:, :1].contiguous(), 40)


def test_unpack_gives_the_grid_weight_back(kernels):
    weight = _gguf_dequantized(40, 128, gguf.GGMLQuantizationType.Q4_0)
    assert torch.equal(kernels.q4_unpack(*pack_q4(*find_q4_grid(weight)), 40), weight)


def test_prepack_picks_bf16_or_fp32_with_a_q4_copy(kernels):
    model = nn.Module()
    model.grid = _grid_linear(64, 64, True)
    model.bf16 = nn.Linear(64, 64)
    with torch.no_grad():
        model.bf16.weight.copy_(model.bf16.weight.bfloat16().float())
    model.fp32 = nn.Linear(64, 64)
    stats = prepack_linears_(model)
    fp32_type = fp32_layer_type()
    assert isinstance(model.grid, Q4Linear) and type(model.grid.dense) is fp32_type
    assert isinstance(model.bf16, Bf16Linear) and type(model.fp32) is fp32_type
    assert stats["q4"] == 1 and stats["bf16"] == 1


def test_compact_weights_switch_keeps_fp32(monkeypatch):
    monkeypatch.setenv(linear_mod.COMPACT_ENV_VAR, "0")
    model = nn.Sequential(_grid_linear(64, 64, False))
    assert prepack_linears_(model)["q4"] == 0
    assert not isinstance(model[0], Q4Linear)
