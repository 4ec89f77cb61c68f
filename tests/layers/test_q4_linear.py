"""Q4Linear: weights on a 4-bit grid (dequantized Q4_0 / Q4_1) kept as 4-bit, multiplied in fp32 by the C++ kernel."""

import gguf
import numpy as np
import pytest
import torch
from torch import nn

from ascendserve.layers import compact_linear
from ascendserve.layers.compact_linear import (A8_TILES, Q4_KERNEL_MAX_ROWS, Bf16Linear, Q4Linear, a8_tile_name,
                                               find_q4_grid, pack_q4)
from ascendserve.layers.prepack import prepack_linears_
from ascendserve.platforms.cpu import cpu_flags
from tests.layers.kernel_checks import (assert_bf16x_is_the_fp32_kernel, assert_bf16x_rows_do_not_depend_on_their_batch,
                                       assert_kernel_rows, assert_kernel_up_to_max_rows, fp32_layer_type)


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
    assert_kernel_up_to_max_rows(q4, layer, compact_linear.Q4_KERNEL_MAX_ROWS, monkeypatch)
    assert q4.q.numel() == 96 * 576 // 2 and q4.bias is layer.bias  # half a byte per weight, plus d and m per 32


# -- bf16 activations (a model run in bf16 with --quantization int4): q4_linear_bf16x ------------------------
@pytest.mark.parametrize("n,k,group", [(1, 32, 32), (40, 256, 64), (96, 96, 32), (200, 1536, 64), (33, 36, 6)])
@pytest.mark.parametrize("bias", [True, False])
def test_bf16x_kernel_is_the_fp32_kernel_on_the_same_bf16_input(kernels, n, k, group, bias):
    """q in 0..15 is exact in bf16 (group 6: an odd number of input pairs per block)."""
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    d = torch.rand(n, k // group) * 0.01
    m = -torch.rand(n, k // group) * 0.05
    weight = (q.double().view(n, -1, group) * d.double()[..., None] + m.double()[..., None]).view(n, k)
    assert_bf16x_is_the_fp32_kernel(kernels.q4_linear_bf16x, kernels.q4_linear, pack_q4(q, d, m), weight,
                                    torch.randn(n) if bias else None)


def test_bf16x_rows_do_not_depend_on_their_batch(kernels):
    q = torch.randint(0, 16, (96, 512), dtype=torch.uint8)
    packed = pack_q4(q, torch.rand(96, 8) * 0.01, -torch.rand(96, 8) * 0.05)
    assert_bf16x_rows_do_not_depend_on_their_batch(kernels.q4_linear_bf16x, packed, 96, 512)


def test_bf16x_kernel_rejects_mismatched_inputs(kernels):
    packed = pack_q4(torch.zeros(40, 64, dtype=torch.uint8), torch.ones(40, 2), torch.zeros(40, 2))
    with pytest.raises(RuntimeError, match="x must be a contiguous bf16"):
        kernels.q4_linear_bf16x(torch.randn(3, 64), *packed, 40, None, True)
    with pytest.raises(RuntimeError, match="x has 32 columns, the weight 64"):
        kernels.q4_linear_bf16x(torch.randn(3, 32).bfloat16(), *packed, 40, None, True)
    with pytest.raises(RuntimeError, match="bias must be a contiguous fp32"):
        kernels.q4_linear_bf16x(torch.randn(3, 64).bfloat16(), *packed, 40, torch.zeros(40).bfloat16(), True)


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
    monkeypatch.setenv(compact_linear.COMPACT_ENV_VAR, "0")
    model = nn.Sequential(_grid_linear(64, 64, False))
    assert prepack_linears_(model)["q4"] == 0
    assert not isinstance(model[0], Q4Linear)


# -- int8 activations (--activation-quantization int8): q4_a8_linear ---------------------------------------
def _a8_reference(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bias) -> torch.Tensor:
    """What the int8-activation kernel computes, in fp64 from the unpacked grid: each row of x rounded per
    32 inputs to qx = round(x * 127 / max|x|) (half to even), the 4-bit values times qx, times d and that
    block's max|x| / 127, plus m times the exact sum of x over the block."""
    rows, k = x.shape
    blocks = x.view(rows, k // 32, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    # 127.0 / amax as a true fp32 division, as the kernel does (torch's `127 / amax` multiplies by the
    # reciprocal: an ulp off at times, enough to round a value at .5 the other way)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    qx = torch.round(blocks * inv).double()
    dx = (amax / 127).double()
    group = k // d.shape[1]
    d_b, m_b = (t.double().repeat_interleave(group // 32, 1) for t in (d, m))  # [N, K/32]
    isum = torch.einsum("rbi,nbi->rnb", qx, q.double().view(q.shape[0], k // 32, 32))
    out = (isum * d_b[None] * dx.view(rows, 1, -1)).sum(-1) + blocks.double().sum(-1) @ m_b.t()
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("n,k,group", [(1, 32, 32), (37, 64, 32), (64, 576, 32), (200, 1536, 32), (70, 128, 64),
                                       (40, 192, 96)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("op", ["q4_a8_linear", "q4_a8_linear_portable"])
def test_a8_kernel_is_the_int8_product_of_the_rounded_input(kernels, n, k, group, bias, op):
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    d = torch.rand(n, k // group) * 0.01
    m = -torch.rand(n, k // group) * 0.05
    b = torch.randn(n) if bias else None
    packed = pack_q4(q, d, m)
    for rows in (1, 2, 3, 4, 5, 9, 64, 130):
        x = torch.randn(rows, k) * torch.rand(rows, 1) * 4
        x[0, :32] = 0  # a block of zeros: dx = 0, qx = 0
        out = getattr(kernels, op)(x, *packed, n, b)
        ref = _a8_reference(x, q, d, m, b)
        # The integer block sums are exact; fp32 sums of the blocks' terms remain.
        scale = (_a8_reference(x.abs(), q, d, m.abs(), None if b is None else b.abs())).clamp(min=1e-30)
        assert out.shape == (rows, n) and ((out.double() - ref).abs() <= 1e-5 * scale).all(), (rows, op)


def test_a8_kernel_is_close_to_the_fp32_product(kernels):
    """Not bit-exact: rounding x to int8 moves each input by at most half a step, max |x| / 254 of its
    block of 32, so the product moves by at most sum_k |w_k| * that (plus fp32 rounding)."""
    layer = _grid_linear(96, 576, True)
    packed = pack_q4(*find_q4_grid(layer.weight.detach()))
    x = torch.randn(50, 576)
    out = kernels.q4_a8_linear(x, *packed, 96, layer.bias).double()
    ref = torch.nn.functional.linear(x.double(), layer.weight.double(), layer.bias.double())
    half_steps = (x.view(50, -1, 32).abs().amax(-1, keepdim=True) / 254).expand(50, 18, 32).reshape(50, 576)
    bound = torch.nn.functional.linear(half_steps.double(), layer.weight.double().abs())
    scale = torch.nn.functional.linear(x.double().abs(), layer.weight.double().abs())
    assert ((out - ref).abs() <= bound + 1e-5 * scale).all()
    assert (out - ref).abs().max() > 1e-4 * scale.max()  # it does round (this is not the fp32 kernel)


@pytest.mark.parametrize("op", ["q4_a8_linear", "q4_a8_linear_portable"])
def test_a8_kernel_passes_nan_and_inf_on_as_the_fp32_kernel_does(kernels, op):
    """A NaN or inf input (a broken layer upstream) must not be rounded into finite int8 garbage: its row comes
    out NaN, as from the fp32 kernel, and the other rows are untouched."""
    q = torch.randint(0, 16, (64, 128), dtype=torch.uint8)
    packed = pack_q4(q, torch.rand(64, 4) * 0.01, -torch.rand(64, 4) * 0.05)
    x = torch.randn(4, 128)
    x[1, 5], x[2, 40] = float("nan"), float("inf")
    out, fp32 = getattr(kernels, op)(x, *packed, 64, None), kernels.q4_linear(x, *packed, 64, None)
    assert out[1:3].isnan().all() and fp32[1:3].isnan().all()
    assert out[[0, 3]].isfinite().all()


def test_a8_kernel_runs_the_vnni_tile_as_the_cpu_has_it(kernels):
    flags = cpu_flags()  # built with -march=native
    tile = "avx512_vnni" if {"avx512f", "avx512_vnni"} <= flags else "avx2" if {"avx2", "fma"} <= flags else "portable"
    assert kernels.q4_a8_tile() == tile
    assert a8_tile_name(kernels) == A8_TILES[tile]


def test_a8_kernel_rejects_a_block_size_it_cannot_take(kernels):
    q = torch.randint(0, 16, (32, 96), dtype=torch.uint8)
    packed = pack_q4(q, torch.rand(32, 2), torch.rand(32, 2))  # blocks of 48 inputs
    with pytest.raises(RuntimeError, match="block size 48 is not a multiple of 32"):
        kernels.q4_a8_linear(torch.randn(2, 96), *packed, 32, None)
    assert kernels.q4_a8_linear(torch.randn(0, 96), *pack_q4(q, torch.rand(32, 3), torch.rand(32, 3)), 32,
                                None).shape == (0, 32)


def test_int8_activations_take_every_batch_of_two_rows_or_more(kernels, monkeypatch):
    """With use_int8_activations() (what --activation-quantization int8 does) the layer multiplies batches
    of 2 rows or more with the int8 kernel, one row with the fp32 one, the fp32 layer it wraps never."""
    layer = _grid_linear(96, 576, True)
    q4 = Q4Linear(layer, find_q4_grid(layer.weight.detach()), kernels)
    q4.use_int8_activations()
    monkeypatch.setattr(layer, "forward", lambda x: pytest.fail("the fp32 layer ran"))
    x = torch.randn(1, 576)
    assert torch.equal(q4(x), kernels.q4_linear(x, q4.q, q4.scales, q4.mins, 96, layer.bias))
    for rows in (2, 7, Q4_KERNEL_MAX_ROWS + 1, 300):
        x = torch.randn(rows, 576)
        assert torch.equal(q4(x), kernels.q4_a8_linear(x, q4.q, q4.scales, q4.mins, 96, layer.bias))
    x = torch.randn(2, 3, 576)
    assert torch.equal(q4(x), kernels.q4_a8_linear(x.reshape(6, 576), q4.q, q4.scales, q4.mins, 96,
                                                   layer.bias).reshape(2, 3, 96))
    assert "int8 activations" in repr(q4) and "fp32 above" not in repr(q4)
    # the fp32 weight is no longer read, so the layer lets go of it and keeps the bias
    assert not hasattr(q4.dense, "weight") and q4.bias is layer.bias
    assert [name for name, _ in q4.named_parameters()] == ["dense.bias"]


def test_prepack_with_int8_activations_counts_the_4bit_layers(kernels):
    model = nn.Module()
    model.grid = _grid_linear(64, 64, True)
    model.fp32 = nn.Linear(64, 64)
    stats = prepack_linears_(model, int8_activations=True)
    assert stats["int8_activations"] == 1 and model.grid.int8_activations
    assert not isinstance(model.fp32, Q4Linear)
    # no fp32 layer (nor an MKL pack) is made for the 4-bit one: only the plain fp32 layer is counted
    assert not hasattr(model.grid.dense, "weight") and stats["q4"] == 1
    assert type(model.fp32) is fp32_layer_type()
    assert stats["packed"] + stats["onednn"] + stats["panel"] == (fp32_layer_type() is not nn.Linear)
    plain = nn.Module()
    plain.grid = _grid_linear(64, 64, True)
    assert prepack_linears_(plain)["int8_activations"] == 0 and not plain.grid.int8_activations
