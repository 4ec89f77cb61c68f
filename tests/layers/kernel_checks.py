"""The checks the CPU linear-kernel tests share: an fp32 output against an fp64 F.linear; a bf16-activation
kernel against its fp32 twin."""

import torch
import torch.nn.functional as F
from torch import nn

from ascendserve.layers import linear


def fp32_layer_type() -> type:
    """What prepack_linears_ makes of a plain fp32 CPU nn.Linear on this machine."""
    gemm = linear.fp32_gemm()
    if gemm == "panel":
        return linear.PanelLinear
    if gemm == "onednn":
        return linear.DenseLinear
    return linear.PackedLinear if linear.packing_supported() else nn.Linear


def assert_fp32_product(out: torch.Tensor, x: torch.Tensor, layer: nn.Linear) -> None:
    bias = None if layer.bias is None else layer.bias.double()
    ref = F.linear(x.double(), layer.weight.double(), bias)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    # fp32 sums in another order: errors ~1e-7 of the terms' magnitude, sum |x| |w| (+ |b|), not of
    # the output, which may cancel to near zero.
    scale = F.linear(x.double().abs(), layer.weight.double().abs(), None if bias is None else bias.abs())
    error = (out.double() - ref).abs()
    assert (error <= 1e-5 * scale.clamp(min=1e-30)).all(), (x.shape, error.max())


def assert_kernel_rows(op, packed: tuple, layer: nn.Linear, row_counts) -> None:
    """op(x, *packed, n, bias) is the layer's fp32 product for an x of each row count."""
    for rows in row_counts:
        x = torch.randn(rows, layer.in_features)
        assert_fp32_product(op(x, *packed, layer.out_features, layer.bias), x, layer)


def assert_kernel_up_to_max_rows(grid_layer: nn.Module, dense: nn.Linear, max_rows: int, monkeypatch) -> None:
    """A GridLinear multiplies up to max_rows rows with its kernel and more with the fp32 layer it
    wraps; leading dims are flattened and a non-contiguous input is copied."""
    calls = []
    monkeypatch.setattr(dense, "forward", lambda x: calls.append(len(x)) or F.linear(x, dense.weight, dense.bias))
    k, n = dense.in_features, dense.out_features
    for rows in (1, max_rows, max_rows + 1, 300):
        x = torch.randn(rows, k)
        assert_fp32_product(grid_layer(x), x, dense)
    assert calls == [max_rows + 1, 300]
    x = torch.randn(2, 3, k)[:, ::2]
    assert_fp32_product(grid_layer(x).reshape(-1, n), x.reshape(-1, k), dense)


BF16X_ROWS = [1, 2, 3, 7, 12, 13, 25, 300]  # the split 1-2 row sums, the 12-row tile, several tiles


def assert_bf16x_is_the_fp32_kernel(bf16x_op, fp32_op, packed: tuple, weight: torch.Tensor, bias) -> None:
    """bf16x_op(x, *packed, n, bias, bf16_out) on bf16 x: the weight's values exact in bf16 and vdpbf16ps's products
    exact, so the fp32 sums of fp32_op(x widened, *packed, n, bias) in another order, for each of BF16X_ROWS; with
    bf16_out those sums rounded once, to nearest. weight: the dense [N, K] (fp64) the pack holds."""
    n, k = weight.shape
    b64 = None if bias is None else bias.double()
    for rows in BF16X_ROWS:
        x = (torch.randn(rows, k) * 2).bfloat16()
        out = bf16x_op(x, *packed, n, bias, False)
        assert out.dtype == torch.float32 and out.shape == (rows, n)
        ref = F.linear(x.double(), weight, b64)
        scale = F.linear(x.double().abs(), weight.abs(), None if b64 is None else b64.abs())
        assert ((out.double() - ref).abs() <= 1e-5 * scale).all(), rows
        rounded = bf16x_op(x, *packed, n, bias, True)
        assert rounded.dtype == torch.bfloat16 and torch.equal(rounded, out.bfloat16())
        assert ((out - fp32_op(x.float(), *packed, n, bias)).abs().double() <= 1e-5 * scale).all()


def assert_bf16x_rows_do_not_depend_on_their_batch(bf16x_op, packed: tuple, n: int, k: int) -> None:
    """One kernel at every batch size, each row summed in one order: a row alone equals that row in any batch."""
    x = torch.randn(40, k).bfloat16()
    batch = bf16x_op(x, *packed, n, None, True)
    for rows in (slice(0, 1), slice(5, 7), slice(3, 16), slice(11, 40)):
        assert torch.equal(bf16x_op(x[rows].contiguous(), *packed, n, None, True), batch[rows])
