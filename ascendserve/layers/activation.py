"""Gated MLP activations on a fused [gate | up] projection."""

import torch
import torch.nn.functional as F
from torch import nn

from ascendserve.layers import cpu_kernels

_ACTS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class GatedActivation(nn.Module):
    """act(gate) * up for x = [gate | up] along the last dimension."""

    def __init__(self, hidden_act: str) -> None:
        super().__init__()
        if hidden_act not in _ACTS:
            raise ValueError(f"hidden_act {hidden_act!r} is not supported; known: {sorted(_ACTS)}")
        self.act = _ACTS[hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fp32 or bf16 on CPU: gate and up in one pass (csrc/silu_and_mul_cpu.cpp); a compiled forward fuses the
        # torch form instead.
        if self.act is F.silu and (kernels := cpu_kernels.float_ops(x)) is not None:
            return kernels.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return self.act(gate) * up
