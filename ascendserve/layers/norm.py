"""RMSNorm in its two forms: plain weight (Llama) and zero-centred `1 + w` (Qwen3.5)."""

import torch
from torch import nn

from ascendserve.layers import cpu_kernels


def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor):
    """The CPU op (csrc/rms_norm_cpu.cpp) for fp32 or bf16 x (1-4 dims, the last contiguous) and weight outside a
    compiled forward, else None. bf16 is normalized in fp32 and rounded once, as Qwen3.5's norm does (Llama's
    rounds the normalized x before the weight's multiply: a bf16 rounding apart)."""
    return cpu_kernels.float_ops(x, weight) if 1 <= x.dim() <= 4 and x.stride(-1) == 1 else None


class RMSNorm(nn.Module):
    """y = x / rms(x) * w, computed in fp32 and cast back, as transformers' LlamaRMSNorm."""

    unit_offset = False  # the CPU ops' flag: scale by (1 + w) instead of w

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """The norm of x; with `residual`, (the norm of x + residual, x + residual): a pre-norm layer's
        residual add and the next norm, one C++ pass on CPU (vLLM's fused_add_rms_norm)."""
        if residual is None:
            return self._norm(x)
        if (x.dim() == 2 and x.shape == residual.shape and x.is_contiguous() and residual.is_contiguous()
                and x.dtype == residual.dtype
                and (kernels := cpu_kernels.float_ops(x, residual, self.weight)) is not None):
            return kernels.add_rms_norm(x, residual, self.weight, self.eps, self.unit_offset)
        summed = x + residual
        return self._norm(summed), summed

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if (kernels := _rms_norm_op(x, self.weight)) is not None:
            return kernels.rms_norm(x, self.weight, self.eps, self.unit_offset)
        return self._torch_norm(x)

    def _torch_norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class GemmaRMSNorm(RMSNorm):
    """y = x / rms(x) * (1 + w), the multiply in fp32 (Qwen3.5's zero-centred norm)."""

    unit_offset = True

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__(hidden_size, eps)
        self.weight = nn.Parameter(torch.zeros(hidden_size))

    def _torch_norm(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)
