"""The check the CPU linear-kernel tests share: an fp32 output against an fp64 F.linear."""

import torch
import torch.nn.functional as F
from torch import nn


def assert_fp32_product(out: torch.Tensor, x: torch.Tensor, layer: nn.Linear) -> None:
    bias = None if layer.bias is None else layer.bias.double()
    ref = F.linear(x.double(), layer.weight.double(), bias)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    # fp32 sums in another order: errors ~1e-7 of the terms' magnitude, sum |x| |w| (+ |b|), not of
    # the output, which may cancel to near zero.
    scale = F.linear(x.double().abs(), layer.weight.double().abs(), None if bias is None else bias.abs())
    assert ((out.double() - ref).abs() <= 1e-5 * scale.clamp(min=1e-30)).all(), (x.shape, (out.double() - ref).abs().max())
