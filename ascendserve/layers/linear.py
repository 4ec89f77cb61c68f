"""fp32 linear layers for CPU decode: an MKL pre-packed weight, or a bf16-stored one (Bf16Linear, below).

MKL's sgemm copies the weight into its internal panel layout on every call; at decode batch sizes
that copy dominates and F.linear streams weights at only 4-10 GB/s. `cblas_sgemm_pack` does it once
at load: `torch.ops.mkl._mkl_reorder_linear_weight(W, m)` packs W, `torch.ops.mkl._mkl_linear(x, pack,
W, bias, m)` multiplies by the pack when x has exactly m rows (else it silently runs F.linear on W).

Measured with benchmarks/probe_packed_linear.py (weights streamed from DRAM, median ms per call,
variants interleaved call by call) on a shared 2-core AVX-512 Xeon without AMX, 1 thread:
      M   SmolLM2 gate_up 3072x576      SmolLM2 lm_head 49152x576   Qwen3.5 in_proj_qkvz 8192x1024
          F.linear  pad->64  pack64     F.linear  pack64            F.linear  pack64
      1   0.62      1.82     0.61       13.0      13.2              2.71      2.89
      4   1.23      1.84     0.69       32.1      15.0              6.05      3.45
      8   1.60      1.84     0.72       46.2      15.2              9.66      3.91
     16   1.42      1.81     0.87       34.2      21.3              6.52      4.30
     64   2.56      1.81     1.81       55.0      41.1              11.6      8.31
    128   4.03      -        3.47       94.3      79.1              19.1      17.0
    256   10.9      -        10.8       150       175               32.7      33.6
With 2 threads (noisier: calls stalled by other processes) the curve is the same, e.g. Qwen3.5's
lm_head 248320x1024: M=1 89.6 vs 109, M=4 189 vs 113, M=8 275 vs 115, M=128 576 vs 554.
  - "pad->64": x zero-padded to the pack's 64 rows (MKL's documented use: pack and compute with the
    same m). "pack64": the pack made for 64 rows, called with x's own M. This MKL computes any M
    from one pack, equal to F.linear to fp32 rounding, and as fast as a pack made for that M; a
    pack made for 16 rows was up to 2x slower from 64 rows on. So: one pack per layer, made for
    PACK_ROWS, used for MIN_PACKED_ROWS <= M <= MAX_PACKED_ROWS; F.linear outside (M <= 3: its gemv
    path was as fast, or 10-20% faster at K >= 1024; prefill chunks: compute-bound, no gain).
    `_pack_takes_any_rows` checks the any-M behaviour once per weight shape at packing time; where
    it fails, M <= PACK_ROWS is padded to PACK_ROWS rows instead.
  - The pack is resident memory about the size of the weight (its reserved address range is up to
    several times larger for small matrices, but untouched pages cost nothing). It is made at load,
    before the KV cache is sized, so the CPU budget (a share of MemAvailable) already sees it.
  - The pack is a plain attribute, not a buffer: MKL forbids moving a pack (its metadata depends on
    the address's alignment), so nothing (state_dict, .to()) may copy it; the weight must not
    change after packing. The layer keeps the original Parameter: a tied lm_head stays tied.

Set ASCENDSERVE_PACKED_LINEAR=0 to keep plain F.linear (for A/B timing).

bf16 weights, fp32 compute (Bf16Linear): a bf16 checkpoint run in fp32 (`--dtype auto` on a CPU without
native bf16) loads every weight as fp32 though all of them are exact bf16 values. Such a layer keeps
its weight as bf16 in a panel layout and multiplies with the C++ kernel in csrc/bf16_linear_cpu.cpp,
which widens the weight in registers (exact) and accumulates in fp32: the same products as F.linear on
the fp32 weight, half the bytes per decode step and half the memory, and no MKL pack beside it.
Chosen per layer by the data (every weight bf16-exact, in_features even), not by a flag, so an fp32
checkpoint (or a dequantized GGUF) keeps the MKL path. Measured with /tmp-style probes, 2 threads,
ms per call, fp32 F.linear / MKL pack / this kernel:
      shape (N x K)            M=1               M=8               M=64              M=256
      Qwen3.5 8192x1024        1.52/2.14/0.58    4.85/2.54/1.58    8.25/5.99/7.23    23.6/-/28.0
      Qwen3.5 1024x3584        0.40/0.49/0.18    1.11/0.63/0.41    3.27/2.80/2.76    10.0/-/10.4
      SmolLM2 49152x576        5.60/5.72/3.34    21.7/7.41/5.38    27.0/18.7/23.2    109/-/117
Above BF16_KERNEL_MAX_ROWS (prefill chunks, compute-bound) the layer widens the whole weight to fp32
for that call and runs F.linear: MKL's GEMM is 10-30% faster there than the kernel, and the widening
(a few ms per layer) is small beside it. ASCENDSERVE_BF16_WEIGHTS=0 keeps such layers in fp32.
"""

import torch
import torch.nn.functional as F
from torch import nn

from ascendserve.config import env_switch
from ascendserve.logger import init_logger

logger = init_logger(__name__)

ENV_VAR = "ASCENDSERVE_PACKED_LINEAR"
BF16_ENV_VAR = "ASCENDSERVE_BF16_WEIGHTS"
BF16_PANEL = 32  # output rows per panel of the bf16 pack (csrc/bf16_linear_cpu.cpp)
BF16_KERNEL_MAX_ROWS = 256  # above, widen the weight for the call and use F.linear (see the docstring)
PACK_ROWS = 64  # the m each weight is packed for
MIN_PACKED_ROWS = 4  # below, F.linear (MKL's gemv) was as fast, or faster for K >= 1024
MAX_PACKED_ROWS = 128  # above, F.linear was as fast or faster (prefill)


def packing_supported() -> bool:
    """Whether torch has MKL's packed GEMM ops and packing is not turned off by ASCENDSERVE_PACKED_LINEAR=0."""
    if env_switch(ENV_VAR) is False:
        return False
    return (torch.backends.mkl.is_available() and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight") and hasattr(torch.ops.mkl, "_mkl_linear"))


class PackedLinear(nn.Module):
    """y = x @ W.T + b with W (fp32, CPU) also held as an MKL pack, used for batches of 4..max_rows rows."""

    def __init__(self, linear: nn.Linear, any_rows: bool | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # the same Parameter: ties (embedding / lm_head) survive
        self.register_parameter("bias", linear.bias)
        self.pack = torch.ops.mkl._mkl_reorder_linear_weight(self.weight.detach(), PACK_ROWS)
        if any_rows is None:
            any_rows = _pack_takes_any_rows(self.weight.detach(), self.pack)
        self.any_rows = any_rows
        self.max_rows = MAX_PACKED_ROWS if any_rows else PACK_ROWS

    @staticmethod
    def supports(linear: nn.Linear) -> bool:
        """fp32 weights on CPU only (the MKL pack is fp32 and host memory)."""
        return linear.weight.dtype == torch.float32 and linear.weight.device.type == "cpu"

    def pack_bytes(self) -> int:
        """Bytes reserved for the pack (resident: about the weight's size)."""
        return self.pack.numel() * self.pack.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if not MIN_PACKED_ROWS <= rows <= self.max_rows:
            return F.linear(x, self.weight, self.bias)
        if self.any_rows or rows == PACK_ROWS:
            return torch.ops.mkl._mkl_linear(x, self.pack, self.weight, self.bias, rows)
        padded = F.pad(x.reshape(rows, self.in_features), (0, 0, 0, PACK_ROWS - rows))
        out = torch.ops.mkl._mkl_linear(padded, self.pack, self.weight, self.bias, PACK_ROWS)
        return out[:rows].reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        padded = "" if self.any_rows else f" (padded to {PACK_ROWS})"
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"packed_rows={MIN_PACKED_ROWS}..{self.max_rows}{padded}")


class Bf16Linear(nn.Module):
    """y = x @ W.T + b, fp32 in and out, with W held as bf16 panels (exact for a bf16-valued weight)."""

    def __init__(self, linear: nn.Linear, kernels) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.kernels = kernels
        self.register_buffer("packed", pack_bf16(linear.weight.detach()), persistent=False)
        self.register_parameter("bias", linear.bias)

    @staticmethod
    def supports(linear: nn.Linear) -> bool:
        """fp32 on CPU, in_features even, and every weight value exactly representable in bf16."""
        weight = linear.weight
        return (weight.dtype == torch.float32 and weight.device.type == "cpu" and linear.in_features % 2 == 0
                and not (weight.detach().view(torch.int32) & 0xFFFF).any())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, self.in_features).contiguous()
        if x.shape[0] <= BF16_KERNEL_MAX_ROWS:
            out = self.kernels.bf16_linear(x, self.packed, self.out_features, self.bias)
        else:
            out = F.linear(x, self.kernels.bf16_unpack(self.packed, self.out_features), self.bias)
        return out.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, " \
               f"weight=bf16 (fp32 compute)"


def pack_bf16(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] -> [ceil(N/32), K/2, 32, 2] bf16: panels of 32 rows, each input pair of a row side by side."""
    n, k = weight.shape
    panels = -(-n // BF16_PANEL)
    padded = torch.zeros(panels * BF16_PANEL, k, dtype=torch.bfloat16)
    padded[:n] = weight
    return padded.view(panels, BF16_PANEL, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def _pack_takes_any_rows(weight: torch.Tensor, pack: torch.Tensor) -> bool:
    """Whether MKL computes batches of other row counts right from a pack made for PACK_ROWS rows."""
    gen = torch.Generator().manual_seed(0)
    for rows in (MIN_PACKED_ROWS + 1, PACK_ROWS + 7):
        x = torch.randn(rows, weight.shape[1], generator=gen)
        ref = F.linear(x, weight)
        out = torch.ops.mkl._mkl_linear(x, pack, weight, None, rows)
        if not (out - ref).abs().max() <= 1e-4 * ref.abs().max().clamp(min=1e-30):
            return False
    return True


def prepack_linears_(model: nn.Module) -> dict[str, int]:
    """Replace the model's fp32 CPU nn.Linear layers in place; returns counts and bytes.

    A layer whose weight is all bf16 values becomes a Bf16Linear (when the CPU kernels are built and
    ASCENDSERVE_BF16_WEIGHTS is not 0); any other fp32 CPU layer a PackedLinear (when torch has MKL's
    packed GEMM and ASCENDSERVE_PACKED_LINEAR is not 0). A no-op (zeros) where neither applies, e.g.
    bf16 or non-CPU layers. Call after the weights are loaded.
    """
    stats = {"packed": 0, "weight_bytes": 0, "pack_bytes": 0, "padded": 0, "bf16": 0, "bf16_bytes": 0}
    bf16_allowed, mkl = env_switch(BF16_ENV_VAR) is not False, packing_supported()
    kernels = None  # loaded at the first bf16-valued layer: a model without one never builds them here
    any_rows_by_shape: dict[tuple[int, int], bool] = {}
    with torch.no_grad():
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if not isinstance(child, nn.Linear):
                    continue
                use_bf16 = bf16_allowed and Bf16Linear.supports(child)
                if use_bf16 and kernels is None:
                    kernels = _cpu_kernels()
                    bf16_allowed = use_bf16 = kernels is not None
                if use_bf16:
                    setattr(parent, name, Bf16Linear(child, kernels))
                    stats["bf16"] += 1
                    stats["bf16_bytes"] += child.weight.numel() * 2
                elif mkl and PackedLinear.supports(child):
                    shape = tuple(child.weight.shape)
                    layer = PackedLinear(child, any_rows_by_shape.get(shape))
                    any_rows_by_shape[shape] = layer.any_rows
                    setattr(parent, name, layer)
                    stats["packed"] += 1
                    stats["padded"] += not layer.any_rows
                    stats["weight_bytes"] += child.weight.numel() * child.weight.element_size()
                    stats["pack_bytes"] += layer.pack_bytes()
    if stats["bf16"]:
        logger.info("%d fp32 linear layers hold bf16 values (a bf16 checkpoint): kept as bf16 (%.1f MiB, half "
                    "the fp32 size) and multiplied in fp32 by the CPU kernel; %s=0 keeps them fp32",
                    stats["bf16"], stats["bf16_bytes"] / 2**20, BF16_ENV_VAR)
    if stats["packed"]:
        rows = f"{MIN_PACKED_ROWS}..{MAX_PACKED_ROWS} rows" if not stats["padded"] else \
            f"{MIN_PACKED_ROWS}..{PACK_ROWS} rows padded to {PACK_ROWS} on {stats['padded']} layers (this MKL needs it)"
        logger.info("MKL-packed %d fp32 linear layers for batches of %s (F.linear outside): about %.1f MiB "
                    "more memory (%.1f MiB reserved); ASCENDSERVE_PACKED_LINEAR=0 turns this off",
                    stats["packed"], rows, stats["weight_bytes"] / 2**20, stats["pack_bytes"] / 2**20)
    return stats


def _cpu_kernels():
    """The CPU kernel namespace, None when they are turned off or did not build (cpu_kernels warns)."""
    from ascendserve.layers import cpu_kernels
    return cpu_kernels.ops()
