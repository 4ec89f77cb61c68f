"""Q8Linear: weights on an 8-bit grid (dequantized Q8_0, like the demo's tied lm_head) kept as 8-bit,
multiplied in fp32 by the C++ kernel; and the same panels times bf16 x (q8_linear_bf16x, --quantization int8 in a
bf16 model)."""

import gguf
import numpy as np
import pytest
import torch
from torch import nn

from ascendserve.layers import compact_linear
from ascendserve.layers.compact_linear import Q4Linear, Q8Linear, find_q4_grid, find_q8_grid, pack_q8
from ascendserve.layers.prepack import prepack_linears_
from tests.layers.kernel_checks import (assert_bf16x_is_the_fp32_kernel, assert_bf16x_rows_do_not_depend_on_their_batch,
                                       assert_fp32_product, assert_kernel_rows, assert_kernel_up_to_max_rows)


def _q8_0(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """A random [N, K] weight through llama.cpp's own Q8_0 quantize / dequantize (the gguf package's reference)."""
    rng = np.random.default_rng(seed)
    weight = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    qtype = gguf.GGMLQuantizationType.Q8_0
    return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(weight, qtype), qtype).reshape(n, k).copy())


def _grid_linear(n: int, k: int, bias: bool, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    layer = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(_q8_0(n, k, seed))
    return layer


def test_grid_of_a_dequantized_q8_0_is_found_exactly():
    weight = _q8_0(96, 576)
    weight[3, :32] = 0  # an all-zero block: d = 0
    q, d = find_q8_grid(weight)
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127 and d.shape == (96, 576 // 32)
    assert torch.equal((q.float().view(96, -1, 32) * d[..., None]).reshape(96, 576), weight)
    assert find_q4_grid(weight) is None  # not mistaken for a 4-bit grid


def test_weights_off_the_8_bit_grid_are_not_taken():
    assert find_q8_grid(torch.randn(64, 64)) is None
    assert find_q8_grid(torch.randn(64, 48)) is None  # K not a multiple of 32
    weight = _q8_0(64, 64)
    weight[63, 5] += 1e-4  # one value off its block's grid
    assert find_q8_grid(weight) is None


SHAPES = [(1, 32), (37, 64), (64, 576), (200, 1536)]  # (N, K): N around the 32-row panel
ROWS = [1, 2, 5, 6, 7, 13, 64, 65, 300]  # around the 6-row tile and the row chunk


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("op", ["q8_linear", "q8_linear_portable"])
def test_kernel_is_the_fp32_product_of_the_grid_weight(kernels, n, k, bias, op):
    layer = _grid_linear(n, k, bias)
    assert_kernel_rows(getattr(kernels, op), pack_q8(*find_q8_grid(layer.weight.detach())), layer, ROWS)


def test_layer_runs_its_fp32_layer_above_the_kernel_rows(kernels, monkeypatch):
    layer = _grid_linear(96, 576, True)
    q8 = Q8Linear(layer, find_q8_grid(layer.weight.detach()), kernels)
    assert_kernel_up_to_max_rows(q8, layer, compact_linear.Q8_KERNEL_MAX_ROWS, monkeypatch)
    assert q8.q.numel() == 96 * 576 and q8.bias is layer.bias  # a byte per weight, plus d per 32


@pytest.mark.parametrize("op", ["q8_linear", "q8_linear_portable"])
def test_odd_block_sizes_are_the_fp32_product(kernels, op):
    # 63 inputs in 3 blocks of 21: the one-row tile takes inputs in pairs, then a block's odd last one.
    torch.manual_seed(0)
    q = torch.randint(-127, 128, (40, 63), dtype=torch.int8)
    d = torch.rand(40, 3) * 0.01
    layer = nn.Linear(63, 40)
    with torch.no_grad():
        layer.weight.copy_((q.float().view(40, 3, 21) * d[..., None]).view(40, 63))
    assert_kernel_rows(getattr(kernels, op), pack_q8(q, d), layer, [1, 2, 5])


def test_kernel_rejects_mismatched_inputs(kernels):
    q, scales = pack_q8(*find_q8_grid(_q8_0(40, 64)))
    with pytest.raises(RuntimeError, match="x has 32 columns, the weight 64"):
        kernels.q8_linear(torch.randn(3, 32), q, scales, 40, None)
    with pytest.raises(RuntimeError, match="n=70 does not match 2 panels"):
        kernels.q8_linear(torch.randn(3, 64), q, scales, 70, None)
    with pytest.raises(RuntimeError, match="K=64 is not 3 equal blocks"):
        kernels.q8_linear(torch.randn(3, 64), q, scales.new_zeros(2, 3, 32), 40, None)
    with pytest.raises(RuntimeError, match="q must be"):
        kernels.q8_linear(torch.randn(3, 64), q.view(torch.uint8), scales, 40, None)


def test_prepack_keeps_a_q8_copy_and_a_tied_head_stays_tied(kernels):
    model = nn.Module()
    model.embed = nn.Embedding(64, 64)
    with torch.no_grad():
        model.embed.weight.copy_(_q8_0(64, 64, seed=1))
    model.head = nn.Linear(64, 64, bias=False)
    model.head.weight = model.embed.weight
    model.q4 = nn.Linear(64, 64)
    with torch.no_grad():
        model.q4.weight.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(
            np.random.default_rng(2).standard_normal((64, 64)).astype(np.float32) * 0.05,
            gguf.GGMLQuantizationType.Q4_1), gguf.GGMLQuantizationType.Q4_1).reshape(64, 64).copy()))
    stats = prepack_linears_(model)
    assert isinstance(model.head, Q8Linear) and isinstance(model.q4, Q4Linear)
    assert stats["q8"] == 1 and stats["q4"] == 1
    assert model.head.dense.weight is model.embed.weight  # still the embedding's parameter
    reference = nn.Linear(64, 64, bias=False)
    reference.weight = model.embed.weight
    x = torch.randn(3, 64)
    assert_fp32_product(model.head(x), x, reference)


def test_compact_weights_switch_keeps_the_q8_layer_fp32(monkeypatch):
    monkeypatch.setenv(compact_linear.COMPACT_ENV_VAR, "0")
    model = nn.Sequential(_grid_linear(64, 64, False))
    assert prepack_linears_(model)["q8"] == 0
    assert not isinstance(model[0], Q8Linear)


# -- bf16 activations (a model run in bf16 with --quantization int8): q8_linear_bf16x ------------------------
@pytest.mark.parametrize("n,k,group", [(1, 32, 32), (40, 256, 32), (96, 96, 32), (200, 1536, 32), (33, 36, 6)])
@pytest.mark.parametrize("bias", [True, False])
def test_bf16x_kernel_is_the_fp32_kernel_on_the_same_bf16_input(kernels, n, k, group, bias):
    """q in -127..127 is exact in bf16 (group 6: an odd number of input pairs per block)."""
    torch.manual_seed(n + k)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    d = torch.rand(n, k // group) * 0.01
    weight = (q.double().view(n, -1, group) * d.double()[..., None]).view(n, k)
    assert_bf16x_is_the_fp32_kernel(kernels.q8_linear_bf16x, kernels.q8_linear, pack_q8(q, d), weight,
                                    torch.randn(n) if bias else None)


def test_bf16x_rows_do_not_depend_on_their_batch(kernels):
    packed = pack_q8(torch.randint(-127, 128, (96, 512), dtype=torch.int8), torch.rand(96, 16) * 0.01)
    assert_bf16x_rows_do_not_depend_on_their_batch(kernels.q8_linear_bf16x, packed, 96, 512)


def test_bf16x_kernel_rejects_mismatched_inputs(kernels):
    packed = pack_q8(torch.zeros(40, 64, dtype=torch.int8), torch.ones(40, 2))
    with pytest.raises(RuntimeError, match="x must be a contiguous bf16"):
        kernels.q8_linear_bf16x(torch.randn(3, 64), *packed, 40, None, True)
    with pytest.raises(RuntimeError, match="x has 32 columns, the weight 64"):
        kernels.q8_linear_bf16x(torch.randn(3, 32).bfloat16(), *packed, 40, None, True)
    with pytest.raises(RuntimeError, match="bias must be a contiguous fp32"):
        kernels.q8_linear_bf16x(torch.randn(3, 64).bfloat16(), *packed, 40, torch.zeros(40).bfloat16(), True)


# -- int8 activations (--quantization int8 --activation-quantization int8): q8_a8_linear ----------------------
@pytest.mark.parametrize("op", ["q8_a8_linear", "q8_a8_linear_portable"])
@pytest.mark.parametrize("n,k", [(40, 64), (96, 256), (33, 1024)])
def test_a8_kernel_is_the_fp32_product_of_the_int8_rounded_input(kernels, op, n, k):
    """x rounded to int8 per 32 inputs (dx = max |x| / 127); the 8-bit weights made unsigned bytes (+128) for
    vpdpbusd and the offset taken off through -128 d: the fp32 product of the two grids, to fp32 rounding."""
    torch.manual_seed(n + k)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    d = torch.rand(n, k // 32) * 0.01
    q_packed, scales = pack_q8(q, d)
    weight = (q.double().view(n, -1, 32) * d.double()[..., None]).view(n, k)
    bias = torch.randn(n)
    for rows in (1, 2, 6, 7, 65):  # around the 6-row VNNI tile and the portable 4-row one
        x = torch.randn(rows, k)
        blocks = x.view(rows, -1, 32)
        amax = blocks.abs().amax(-1)  # the kernel's arithmetic, in fp32: qx = round(x * (127 / amax)), dx = amax / 127
        qx = torch.round(blocks * (127 / amax)[..., None])
        xq = (qx.double() * (amax / 127).double()[..., None]).view(rows, k)
        out = getattr(kernels, op)(x, q_packed, scales, n, bias)
        ref = xq @ weight.T + bias.double()
        scale = xq.abs() @ weight.abs().T + bias.double().abs()
        assert out.dtype == torch.float32 and ((out.double() - ref).abs() <= 1e-5 * scale).all(), rows


def test_a8_kernel_rejects_mismatched_inputs(kernels):
    q, scales = pack_q8(torch.zeros(40, 64, dtype=torch.int8), torch.ones(40, 2))
    with pytest.raises(RuntimeError, match="q8_a8_linear: x must be a contiguous fp32"):
        kernels.q8_a8_linear(torch.randn(3, 64).bfloat16(), q, scales, 40, None)
    with pytest.raises(RuntimeError, match="q8_a8_linear: x has 32 columns, the weight 64"):
        kernels.q8_a8_linear(torch.randn(3, 32), q, scales, 40, None)
    with pytest.raises(RuntimeError, match="q8_a8_linear: q must be"):
        kernels.q8_a8_linear(torch.randn(3, 64), q.view(torch.uint8), scales, 40, None)
