"""Linear layers that keep a compact copy of an fp32 CPU weight whose values all lie on a grid, multiplied in
fp32 by the C++ kernels (csrc/*_linear_cpu.cpp): bf16 (Bf16Linear), a 4-bit grid per 32 inputs (Q4Linear),
an 8-bit one (Q8Linear); and a bf16 token embedding (Bf16Embedding). prepack.py decides which layer gets which.

bf16 weights, fp32 compute (Bf16Linear): a bf16 checkpoint run in fp32 (`--dtype auto` on a CPU without
native bf16) loads every weight as fp32 though all of them are exact bf16 values. Such a layer keeps
its weight as bf16 in a panel layout and multiplies with the C++ kernel in csrc/bf16_linear_cpu.cpp,
which widens the weight in registers (exact) and accumulates in fp32: the same products as F.linear on
the fp32 weight, half the bytes per decode step and half the memory, and no MKL pack beside it.
Chosen per layer by the data (every weight bf16-exact, in_features even), not by a flag, so an fp32
checkpoint (or a dequantized GGUF) keeps the MKL path. Measured like benchmarks/probe_bf16_linear.py
(2 threads, weights streamed from DRAM, ms per call), fp32 F.linear / MKL pack / this kernel:
      shape (N x K)            M=1               M=8               M=64              M=256
      Qwen3.5 8192x1024        1.52/2.14/0.58    4.85/2.54/1.58    8.25/5.99/7.23    23.6/-/28.0
      Qwen3.5 1024x3584        0.40/0.49/0.18    1.11/0.63/0.41    3.27/2.80/2.76    10.0/-/10.4
      SmolLM2 49152x576        5.60/5.72/3.34    21.7/7.41/5.38    27.0/18.7/23.2    109/-/117
Above BF16_KERNEL_MAX_ROWS (prefill chunks, compute-bound) the layer widens the whole weight to fp32
for that call and runs the dense GEMM where that is faster than the kernel: on the Xeons above MKL's GEMM
was 10-30% faster there, and the widening (a few ms per layer) is small beside it; on the 2-vCPU AMD
EPYC (AVX2) the kernel was the faster (Qwen3.5's layer shapes, 2048 rows: 154 vs 131 GFLOP/s widened into
oneDNN's GEMM; 512 rows: 175 vs 123). bf16_kernel_for_large_batches() chooses by the tiles' instruction set.
ASCENDSERVE_COMPACT_WEIGHTS=0 keeps such layers in fp32.

4-bit grid, fp32 compute (Q4Linear): a Q4_0 / Q4_1 GGUF (the demo model is Q4_1) is dequantized at load
to fp32 values that are, per block of 32 inputs of a row, m + d * q with q in 0..15. find_q4_grid finds
d, m and q from the values (and checks every value is reproduced; in practice bit for bit), and the
layer keeps q as half a byte plus d and m per block: an eighth of the fp32 bytes. The kernel
(csrc/q4_linear_cpu.cpp) computes d * sum(x q) + m * sum(x) per block in fp32: the weights' own
products, regrouped. It wins up to some 32 rows (above, MKL's fp32 GEMM, no longer bound by the weight
bytes, outruns a kernel that spends its time widening nibbles), so the layer keeps its fp32 (MKL-packed)
form for larger batches and holds the 4-bit copy beside it.

8-bit grid, fp32 compute (Q8Linear): the same for a Q8_0 GGUF tensor, d * q per 32 inputs with q in
-127..127 (find_q8_grid; csrc/q8_linear_cpu.cpp), a byte per weight. The demo's tied token embedding is
Q8_0, so its lm_head, 113 MB of fp32 and the largest read of a single-stream decode step, reads 32 MB.
"""

import os

import torch
import torch.nn.functional as F
from torch import nn

from ascendserve.layers.linear import dense_linear

COMPACT_ENV_VAR = "ASCENDSERVE_COMPACT_WEIGHTS"  # 0: bf16- and 4-bit-valued weights stay fp32
PANEL_ROWS = 32  # output rows per panel of the bf16 and 4-bit packs (csrc/*_linear_cpu.cpp)
BF16_KERNEL_MAX_ROWS = 256  # above, widen the weight for the call and use the dense GEMM, where that is faster
BF16_LARGE_ENV_VAR = "ASCENDSERVE_BF16_LARGE_BATCHES"  # kernel / widen: above BF16_KERNEL_MAX_ROWS; unset: by ISA
Q4_GROUP = 32  # inputs per (d, m) block of the 4-bit grid (csrc/q4_linear_cpu.cpp), GGUF's block size
Q4_KERNEL_MAX_ROWS = 32  # above, the fp32 layer (MKL): see Q4Linear
Q8_GROUP = 32  # inputs per d of the 8-bit grid (csrc/q8_linear_cpu.cpp), GGUF Q8_0's block size
Q8_KERNEL_MAX_ROWS = 24  # above, the fp32 layer (MKL): see Q8Linear


class KernelLinear(nn.Module):
    """A linear with a CPU kernel for batches of up to max_rows rows and another path above."""

    max_rows = 0  # the kernel up to this many rows
    weight_format = ""  # for extra_repr

    def __init__(self, linear: nn.Module, kernels) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The model's [tokens, features] goes in as it is (no reshapes: ~115 calls a decode step).
        flat = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, self.in_features).contiguous()
        out = self._kernel(flat) if flat.shape[0] <= self.max_rows else self._large(flat)
        return out if flat is x else out.reshape(*x.shape[:-1], self.out_features)

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _large(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] above max_rows."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        compute = "bf16 in and out, fp32 sums" if getattr(self, "bf16_io", False) else "fp32 compute"
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, " \
               f"weight={self.weight_format} ({compute})"


def fused_ops_run(kernels, in_features: int) -> bool:
    """Whether the ops fused onto a bf16 layer's sums (bf16_linear_argmax, bf16_linear_silu_mul) run for K =
    in_features: on AMX where K is a multiple of 32, else on the vdpbf16ps tile where the CPU has AVX512-BF16 (the
    tiles bf16_linear_bf16x takes, csrc's fused_on_amx)."""
    return (in_features % 32 == 0 and bool(kernels.bf16_amx())) or bool(kernels.bf16_dot())


class Bf16Linear(KernelLinear):
    """y = x @ W.T + b with W held as bf16 panels: fp32 in and out for an fp32 layer whose values are all bf16 (exact),
    bf16 in and out for a bf16 layer (a model run in bf16: Bf16Linear.for_bf16)."""

    max_rows = BF16_KERNEL_MAX_ROWS
    weight_format = "bf16"

    def __init__(self, linear: nn.Linear, kernels) -> None:
        super().__init__(linear, kernels)
        self.register_parameter("bias", linear.bias)
        self.register_buffer("packed", pack_bf16(linear.weight.detach()), persistent=False)
        self.large_on_kernel = bf16_kernel_for_large_batches()
        self.bf16_io = False
        self.argmax_fused = False

    @staticmethod
    def supports(linear: nn.Linear) -> bool:
        """fp32 on CPU, in_features even, and every weight value exactly representable in bf16."""
        weight = linear.weight
        return (weight.dtype == torch.float32 and weight.device.type == "cpu" and linear.in_features % 2 == 0
                and bf16_valued(weight))

    @classmethod
    def for_bf16(cls, linear: nn.Linear, kernels, fp32_out: bool = False) -> "Bf16Linear":
        """A bf16 CPU layer (in_features even) on the same panels, for every batch: bf16_linear_bf16x multiplies
        bf16 x by them with vdpbf16ps on a CPU with AVX512-BF16 (exact products, fp32 sums: oneDNN's bf16
        arithmetic), else with x widened to fp32; the fp32 sums are rounded to bf16 once, at the end, unless
        fp32_out (the lm_head: fp32 logits, as a sampler upcasts them anyway, without bf16's ties). 2-core AMD
        EPYC (Zen 4, AVX512-BF16, no AMX), weights from DRAM (benchmarks/probe_bf16_linear.py), ms per call, this
        kernel / F.linear's bf16 GEMM (oneDNN) / bf16_linear on fp32 x:
              shape (N x K)          M=1               M=16              M=64             M=1024
              Qwen3.5 8192x1024      0.64/1.76/0.54    1.19/2.35/1.81    3.32/4.44/6.61   48.5/46.3/109
              Qwen3.5 248320x1024    17.3/44.1/20.2    44.0/68.1/75.2    113/143/236      1580/1454/3492
        No batch size left to the dense GEMM: the kernel is level with it at 1024 rows and faster below. Where the CPU
        has AMX (Sapphire Rapids on), every batch multiplies on AMX's tiles from the same panels (every size, so that
        a row's result does not depend on its batch): 2-core Xeon with AMX, ms per call, this kernel on AMX / on
        vdpbf16ps / F.linear's bf16 GEMM (oneDNN, AMX too):
              shape (N x K)          M=16              M=64              M=256             M=1024
              Qwen3.5 8192x1024      0.96/1.57/1.91    1.53/5.93/2.15    4.09/23.5/5.01    14.0/97.4/13.3
              Qwen3.5 248320x1024    23.8/48.1/41.8    37.2/185/67.2     134/731/195       555/3077/669"""
        layer = cls(linear, kernels)
        layer.bf16_io, layer.fp32_out = True, fp32_out
        layer.max_rows = 1 << 62  # the kernel takes every batch
        # argmax's fused op (bf16_linear_argmax): fp32 outputs without a bias, on AMX (K a multiple of its 32 inputs) or
        # on the vdpbf16ps tile
        layer.argmax_fused = fp32_out and linear.bias is None and fused_ops_run(kernels, linear.in_features)
        if linear.bias is not None:
            layer.register_buffer("bias_fp32", linear.bias.detach().float(), persistent=False)
        return layer

    @staticmethod
    def supports_bf16(linear: nn.Linear) -> bool:
        """bf16 on CPU with in_features even."""
        weight = linear.weight
        return weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and linear.in_features % 2 == 0

    def argmax(self, x: torch.Tensor) -> torch.Tensor | None:
        """Per row of bf16 x [M, K], the index of its largest output (argmax_rows of this layer's fp32 outputs: the
        first index of the maximum, the first NaN's where there is one) without making the outputs, where the fused op
        runs: a bf16 layer with fp32 outputs and no bias (the lm_head) on AMX (K a multiple of 32) or where the CPU has
        AVX512-BF16. Else None. Greedy decoding then neither writes the [M, vocab] logits nor reads them back (Qwen3.5,
        64 rows: 64 MB each way)."""
        if not (self.argmax_fused and x.dim() == 2 and x.dtype == torch.bfloat16):
            return None
        return self.kernels.bf16_linear_argmax(x.contiguous(), self.packed, self.out_features)

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        if self.bf16_io:
            bias = self.bias_fp32 if self.bias is not None else None
            return self.kernels.bf16_linear_bf16x(x, self.packed, self.out_features, bias, not self.fp32_out)
        return self.kernels.bf16_linear(x, self.packed, self.out_features, self.bias)

    def _large(self, x: torch.Tensor) -> torch.Tensor:
        if self.large_on_kernel:
            return self._kernel(x)
        # Compute-bound: a GEMM on the weight widened for this call beats the kernel there.
        return dense_linear(x, self.kernels.bf16_unpack(self.packed, self.out_features), self.bias)


class Bf16GateUpSilu(KernelLinear):
    """A bf16 MLP's gate-and-up layer [2I, K] (gate rows first, no bias) with the SiLU-and-mul after it, in one op
    (bf16_linear_silu_mul) on the tile Bf16Linear.for_bf16 would take, AMX or vdpbf16ps: each block's gate and up
    sums rounded to bf16 as that layer rounds them, then silu_and_mul's arithmetic, so the same values as the layer
    and silu_and_mul one after the other, without the [M, 2I] product written to memory and read back. Returns
    [M, I]; the module's activation becomes an identity (prepack.py). Every batch, on the panels in gate / up pairs
    (pack_gate_up). 2-core Xeon with AMX, ms per call, the pair / this (alternated, median of 31): the demo's 2048 x
    576 -> 1536 3.85-4.13 / 3.30-3.32, 256 rows 0.49-0.58 / 0.45-0.46; Qwen3.5's 2048 x 1024 -> 3584 12.9-13.3 /
    13.5-14.4 (the epilogue's vector work costs more beside AMX there), 16-64 rows level. In-process 8 x 256
    prefill: demo 0.39-0.42 -> 0.37-0.38 s, Qwen3.5 level. On the vdpbf16ps tile (2-core Zen 4, no AMX; weights
    from DRAM, median of 5-30 alternated calls): 2048 rows demo 18.1 -> 17.4 ms, Qwen3.5 73.2 -> 70.7 ms; 64-256
    rows 1-3% faster, one row level."""

    max_rows = 1 << 62
    weight_format = "bf16 gate / up panel pairs"

    def __init__(self, linear: nn.Linear, kernels) -> None:
        super().__init__(linear, kernels)
        self.out_features = linear.out_features // 2
        self.bias, self.bf16_io = None, True
        self.register_buffer("packed", pack_gate_up(linear.weight.detach()), persistent=False)

    @staticmethod
    def supports(linear: nn.Linear, kernels) -> bool:
        """bf16 on CPU without a bias, I a multiple of 32, where the kernels multiply on AMX (K a multiple of 32) or
        on the vdpbf16ps tile (K even)."""
        weight = linear.weight
        return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and linear.bias is None
                and linear.in_features % 2 == 0 and linear.out_features % (2 * PANEL_ROWS) == 0
                and fused_ops_run(kernels, linear.in_features))

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.bf16_linear_silu_mul(x, self.packed, self.out_features)


def forced_bf16_large_batches() -> str | None:
    """ASCENDSERVE_BF16_LARGE_BATCHES's value, kernel or widen (None when unset); ValueError for another."""
    value = os.environ.get(BF16_LARGE_ENV_VAR, "").strip().lower()
    if value and value not in ("kernel", "widen"):
        raise ValueError(f"{BF16_LARGE_ENV_VAR}={value!r} is not one of kernel, widen")
    return value or None


def bf16_kernel_for_large_batches() -> bool:
    """Whether Bf16Linear multiplies batches above BF16_KERNEL_MAX_ROWS with its kernel rather than widening the
    weight into the dense GEMM (dense_linear): ASCENDSERVE_BF16_LARGE_BATCHES=kernel / widen when set, else the
    kernel where its tiles are AVX2 (the AMD EPYC: 1.17x faster at 2048 rows), the widened weight where they are
    AVX-512 (the Xeons: MKL's GEMM 10-30% faster). Not probed at load: a probe GEMM small enough to time at start-up
    (1024 rows by a cache-resident 2048 x 1024 weight) timed the widened path at 0.94-1.22x the kernel's between
    processes and picked the slower path once in three (run 52)."""
    forced = forced_bf16_large_batches()
    if forced:
        return forced == "kernel"
    kernels = tile_kernels()
    return kernels is not None and kernels.tile_lanes() == 8


class GridLinear(KernelLinear):
    """A compact copy of an fp32 layer whose values lie on a grid, for batches of up to max_rows rows;
    larger batches run the fp32 layer it wraps (`dense`: its fp32 form from prepack.py, e.g. a PanelLinear)."""

    def __init__(self, dense: nn.Module, kernels) -> None:
        super().__init__(dense, kernels)
        self.dense = dense

    @property
    def bias(self) -> torch.Tensor | None:
        return self.dense.bias

    def _large(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense(x)


A8_TILES = {"avx512_vnni": "vpdpbusd, AVX512-VNNI", "avx2": "vpmaddubsw, AVX2", "portable": "plain C++"}


def a8_tile_name(kernels) -> str:
    """How this build's int8-activation kernel (q4_a8_linear) multiplies, for the load log."""
    return A8_TILES[kernels.q4_a8_tile()]


class Q4Panels:
    """What the layers holding 4-bit panels (pack_q4: q, scales, mins) share: csrc/q4_linear_cpu.cpp's fp32
    kernel, or, once `use_int8_activations()` is called (`--activation-quantization int8`), its int8-activation
    kernel for every batch of two rows or more: x rounded to int8 per 32 inputs (dx = max |x| / 127,
    llama.cpp's Q8_1) and integer products of the 4-bit values (vpmaddubsw), the mins' term on the exact
    sum of x. Not bit-exact. Measured (AMD EPYC, AVX2, 2 threads, median ms per call, weights in cache),
    fp32 4-bit kernel / int8 kernel / oneDNN's fp32 GEMM on the dense weight:
        shape (N x K)   M=1            M=16          M=64               M=256             M=1024
        1536x576        0.057 / 0.050  0.70 / 0.25   2.05 / 0.67 / 2.29  7.39 / 3.23 / 6.63  34.3 / 12.8 / 19.6
        576x1536        0.053 / 0.068  0.69 / 0.26   1.75 / 0.65 / 1.43  7.48 / 2.60 / 4.67  37.9 / 12.1 / 16.9
        8192x1024       0.566 / 0.363  5.66 / 2.21
    With AVX512-VNNI (vpdpbusd: Intel Xeon, family 6 model 207, 2 threads, benchmarks/probe_a8_linear.py, the
    AVX2 tile / the VNNI tile, each in a quiet moment of a noisy host): 3072x576 M=64 1.55 / 0.36, M=2048 33.3 /
    14.5; 576x1536 M=64 0.62 / 0.29, M=2048 20.5 / 9.6, where oneDNN's fp32 GEMM took 24.3 and 11.8.
    One row (single-stream decode) is bound by the weight bytes instead, and the fp32 one-row tile streams
    them faster: 12 Qwen3.5 layers (56 MB, from DRAM) at one row 3.38 ms fp32 vs 4.27 ms int8, at two rows
    5.43 vs 4.26 (the int8 kernel first rewrites each panel as bytes), so a single row keeps it."""

    int8_activations = False

    def use_int8_activations(self) -> None:
        self.int8_activations = True
        self.max_rows = 1 << 62  # the kernels for every batch
        self.weight_format = f"{self.weight_format}, int8 activations per 32 inputs from 2 rows"

    def q4_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scales, self.mins))

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        op = self.kernels.q4_a8_linear if self.int8_activations and x.shape[0] > 1 else self.kernels.q4_linear
        return op(x, self.q, self.scales, self.mins, self.out_features, self.bias)


class Q4Linear(Q4Panels, GridLinear):
    """The 4-bit copy (W = d * q + m per 32 inputs) of an fp32 layer, for batches of up to max_rows rows.

    Larger batches run the fp32 layer it wraps (`dense`: its fp32 form from prepack.py, e.g. a PanelLinear): there
    MKL's GEMM on fp32 beats the 4-bit kernel, which spends its time widening nibbles. Measured in the
    engine (the demo model, decode steps of B rows at 256-token contexts, the bound switched between
    steps of one process, median ms a step), kernel up to 6 rows vs up to 64:
        B=8 66.4 vs 47.7, B=16 72.2 vs 58.5, B=32 111.0 vs 99.4, B=48 167.8 vs 172.6, B=64 219.5 vs 243.6
    (a microbenchmark that called one layer repeatedly had put the crossover near 8 rows: its fp32
    weight sat in the L3 cache, where a model's 0.5 GB does not). So the fp32 weight stays; the 4-bit
    copy adds an eighth of it (plus d and m) and cuts the bytes batches of up to 32 rows read by 5x.
    """

    max_rows = Q4_KERNEL_MAX_ROWS
    weight_format = f"4-bit grid per {Q4_GROUP} inputs up to {Q4_KERNEL_MAX_ROWS} rows, fp32 above"

    def __init__(self, dense: nn.Module, grid: tuple[torch.Tensor, torch.Tensor, torch.Tensor], kernels) -> None:
        super().__init__(dense, kernels)
        q, scales, mins = pack_q4(*grid)
        self.register_buffer("q", q, persistent=False)
        self.register_buffer("scales", scales, persistent=False)
        self.register_buffer("mins", mins, persistent=False)

    def use_int8_activations(self) -> None:
        self.weight_format = f"4-bit grid per {Q4_GROUP} inputs"
        super().use_int8_activations()
        # Every batch now runs the 4-bit kernels, so of the fp32 layer only its bias is read: its weight
        # (8x the 4-bit copy, the demo's 0.4 GB) and any MKL pack of it would be memory for nothing.
        self.dense = BiasOnly(self.dense.bias)


class BiasOnly(nn.Module):
    """What a GridLinear keeps of its fp32 layer once its kernels take every batch: the bias."""

    def __init__(self, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.bias = bias


class Q8Linear(GridLinear):
    """The 8-bit copy (W = d * q, q in -127..127, per 32 inputs) of an fp32 layer, for batches of up to
    max_rows rows: a dequantized Q8_0 GGUF tensor, like the demo model's token embedding, which is also
    its tied lm_head (49152 x 576: 113 MB of fp32 a decode step, 32 MB as 8-bit plus d). Demo decode
    steps of B rows, the bound switched between steps of one process (0: MKL's fp32 GEMM; median ms a
    step): B=1 20.1 -> 16.5, B=8 54.8 -> 51.3, B=16 75.6 -> 74.1, B=24 87.2 -> 84.8, B=32 117.5 -> 123.7,
    so the kernel runs up to 24 rows (its 6-row tile converts each byte to fp32: compute-bound there).
    """

    max_rows = Q8_KERNEL_MAX_ROWS
    weight_format = f"8-bit grid per {Q8_GROUP} inputs up to {Q8_KERNEL_MAX_ROWS} rows, fp32 above"

    def __init__(self, dense: nn.Module, grid: tuple[torch.Tensor, torch.Tensor], kernels) -> None:
        super().__init__(dense, kernels)
        q, scales = pack_q8(*grid)
        self.register_buffer("q", q, persistent=False)
        self.register_buffer("scales", scales, persistent=False)

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.q8_linear(x, self.q, self.scales, self.out_features, self.bias)


def bf16_valued(weight: torch.Tensor, rows_per_pass: int = 4096) -> bool:
    """Whether every value of an fp32 tensor is exactly a bf16 (its low 16 bits zero), a pass over
    rows_per_pass rows at a time (a 248k-token embedding would otherwise need a 1 GB temporary)."""
    flat = weight.detach().reshape(weight.shape[0], -1) if weight.dim() else weight.detach().reshape(1, 1)
    return not any((flat[start:start + rows_per_pass].view(torch.int32) & 0xFFFF).any()
                   for start in range(0, flat.shape[0], rows_per_pass))


class Bf16Embedding(nn.Module):
    """An fp32 CPU token embedding whose values are all bf16 (a bf16 checkpoint run in fp32), held as bf16:
    half the memory, and the rows it looks up widen back to the same fp32 values."""

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.register_buffer("weight", embedding.weight.detach().bfloat16(), persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight).float()

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, weight=bf16 (fp32 out)"


def pack_bf16(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] -> [ceil(N/32), K/2, 32, 2] bf16: panels of 32 rows, each input pair of a row side by side."""
    n, k = weight.shape
    panels = -(-n // PANEL_ROWS)
    padded = torch.zeros(panels * PANEL_ROWS, k, dtype=torch.bfloat16)
    padded[:n] = weight
    return padded.view(panels, PANEL_ROWS, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def pack_gate_up(weight: torch.Tensor) -> torch.Tensor:
    """A gate-and-up weight [2I, K] (gate rows first, I a multiple of 32) as pack_bf16's panels in pairs, gate panel q
    then up panel q ([g0, u0, g1, u1, ...]: csrc/bf16_linear_cpu.cpp's bf16_linear_silu_mul)."""
    two_i, k = weight.shape
    half = two_i // 2
    gate, up = (w.reshape(half // PANEL_ROWS, PANEL_ROWS, k) for w in (weight[:half], weight[half:]))
    return pack_bf16(torch.stack([gate, up], dim=1).reshape(two_i, k))


def find_q4_grid(weight: torch.Tensor, rows_per_pass: int = 4096):
    """(q uint8 [N, K], d [N, K/32], m [N, K/32]) with weight == d * q + m blockwise, else None.

    A dequantized Q4_1 block is m + d * q with m its minimum and d = (max - min) / 15; a Q4_0 block is
    d * (q - 8), i.e. m = -8 d = its largest-magnitude value. Both candidates are tried per block; a
    block fits when every value is reproduced to 2^-20 of the block's largest magnitude (in practice
    exactly). One block that fits neither and the layer stays as it is.
    """
    n, k = weight.shape
    if k % Q4_GROUP:
        return None
    qs, ds, ms = [], [], []
    for start in range(0, n, rows_per_pass):
        blocks = weight[start:start + rows_per_pass].reshape(-1, k // Q4_GROUP, Q4_GROUP)
        lo, hi = blocks.amin(-1), blocks.amax(-1)
        extreme = torch.where(lo.abs() >= hi.abs(), lo, hi)
        fits_q41, q41, d41, m41 = _fit_grid(blocks, (hi - lo) / 15, lo)  # Q4_1: m = the minimum
        fits_q40, q40, d40, m40 = _fit_grid(blocks, -extreme / 8, extreme)  # Q4_0: m = -8 d
        if not bool((fits_q41 | fits_q40).all()):
            return None
        qs.append(torch.where(fits_q41[..., None], q41, q40).to(torch.uint8).reshape(-1, k))
        ds.append(torch.where(fits_q41, d41, d40))
        ms.append(torch.where(fits_q41, m41, m40))
    return torch.cat(qs), torch.cat(ds), torch.cat(ms)


def round_to_grid(blocks: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """q = round((w - m) / d) in 0..15 (as floats) for blocks [..., G] of w with one d and m each (d == 0: q = 0)."""
    safe = torch.where(d == 0, torch.ones_like(d), d)
    return ((blocks - m[..., None]) / safe[..., None]).round_().clamp_(0, 15)


def _fit_grid(blocks: torch.Tensor, d: torch.Tensor, m: torch.Tensor):
    """(fits per block, q, d, m): q = round_to_grid(w), and whether d * q + m gives every w back."""
    q = round_to_grid(blocks, d, m)
    return _reproduces(blocks, q * d[..., None] + m[..., None]), q, d, m


def _reproduces(blocks: torch.Tensor, rebuilt: torch.Tensor) -> torch.Tensor:
    """Per block [..., G]: whether `rebuilt` gives every value back to 2^-20 of the block's largest magnitude."""
    return (rebuilt - blocks).abs().amax(-1) <= blocks.abs().amax(-1) * 2.0 ** -20


def find_q8_grid(weight: torch.Tensor, rows_per_pass: int = 4096):
    """(q int8 [N, K], d [N, K/32]) with weight == d * q blockwise, else None.

    A dequantized Q8_0 block is d * q with q = round(w / d) for d = (its largest magnitude) / 127, so
    that value is d * +-127 and d is found from it (q8_grid). A block fits when every value is reproduced to 2^-20
    of its largest magnitude (in practice exactly); one block that does not and the layer stays as it is.
    """
    n, k = weight.shape
    if k % Q8_GROUP:
        return None
    qs, ds = [], []
    for start in range(0, n, rows_per_pass):
        rows = weight[start:start + rows_per_pass]
        q, d = _q8_rows(rows)
        blocks = rows.reshape(-1, k // Q8_GROUP, Q8_GROUP)
        if not bool(_reproduces(blocks, q.float().view_as(blocks) * d[..., None]).all()):
            return None
        qs.append(q)
        ds.append(d)
    return torch.cat(qs), torch.cat(ds)


def q8_grid(weight: torch.Tensor, rows_per_pass: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """Any [N, K] weight (K a multiple of Q8_GROUP) rounded onto Q8_0's grid: (q int8 [N, K], d fp32 [N, K/32]),
    W ~= d * q per block of 32 inputs, d = the block's largest magnitude / 127, q = round(W / d) (an all-zero block:
    d = 0, q = 0). `--quantization int8` (layers/quantization.py, GridInt8Linear); rows_per_pass bounds the fp32
    copies a large layer (an lm_head) makes."""
    parts = [_q8_rows(weight[start:start + rows_per_pass]) for start in range(0, weight.shape[0], rows_per_pass)]
    return torch.cat([q for q, _ in parts]), torch.cat([d for _, d in parts])


def _q8_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = rows.float().reshape(rows.shape[0], -1, Q8_GROUP)
    d = blocks.abs().amax(-1) / 127
    q = (blocks / torch.where(d == 0, torch.ones_like(d), d)[..., None]).round_().clamp_(-127, 127)
    return q.to(torch.int8).reshape(rows.shape), d


def _panel_lanes(t: torch.Tensor, panels: int) -> torch.Tensor:
    """Per-row, per-block values t [N, B] -> [N/32, B, 32] fp32: a panel's 32 rows side by side, N padded."""
    t = F.pad(t.float(), (0, 0, 0, panels * PANEL_ROWS - t.shape[0]))
    return t.view(panels, PANEL_ROWS, -1).transpose(1, 2).contiguous()


def pack_q4(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor):
    """(q [N/32, K/2, 32] uint8: byte = q[n, 2i] | q[n, 2i+1] << 4; d and m [N/32, K/32, 32] fp32), N padded."""
    n, k = q.shape
    panels = -(-n // PANEL_ROWS)
    q = F.pad(q, (0, 0, 0, panels * PANEL_ROWS - n))
    pairs = (q[:, 0::2] | (q[:, 1::2] << 4)).view(panels, PANEL_ROWS, k // 2).transpose(1, 2).contiguous()
    return pairs, _panel_lanes(d, panels), _panel_lanes(m, panels)


def pack_q8(q: torch.Tensor, d: torch.Tensor):
    """(q [N/32, K, 32] int8: a panel's 32 rows side by side per input; d [N/32, K/32, 32] fp32), N padded."""
    n, k = q.shape
    panels = -(-n // PANEL_ROWS)
    q = F.pad(q, (0, 0, 0, panels * PANEL_ROWS - n)).view(panels, PANEL_ROWS, k).transpose(1, 2).contiguous()
    return q, _panel_lanes(d, panels)


def tile_kernels():
    """The CPU kernel namespace, None when they are turned off or did not build (cpu_kernels warns), or
    when this CPU has neither AVX-512 nor AVX2 with FMA: the kernels' portable loops would be slower than
    MKL's fp32 GEMM."""
    from ascendserve.layers import cpu_kernels
    kernels = cpu_kernels.ops()
    return kernels if kernels is not None and kernels.simd_tiles() else None
