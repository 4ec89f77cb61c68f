"""The check the CPU linear-kernel tests share: an fp32 output against an fp64 F.linear."""

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
