"""Weight-only int8 / int4 quantization of a loaded model's linear layers (opt-in, not bit-exact).

`quantize_model_(model, "int8" | "int4")` swaps every `nn.Linear` (fused qkv_proj / gate_up_proj
included, lm_head included) for a `WeightOnlyLinear`: int8 symmetric per output channel, int4
asymmetric per group of 64 inputs. The embedding stays dense (a gather reads a few rows per step, so
quantizing it saves memory but no time), and so do MoE experts' 3-D parameters (not `nn.Linear`;
left for later).

Kernel choice per call, by the number of rows M. Measured with benchmarks/probe_quant_kernels.py
(1 thread, weights streamed from DRAM, fastest call) on a 2-core AVX-512 Xeon without AMX or
AVX512-BF16, ms per call for SmolLM2's gate_up 3072x576:
      M   fp32 F.linear   int8 kernel (bf16 x)   int4 g64 kernel (bf16 x)   int8 kernel (fp32 x)
      1   0.65            0.24                   0.11                       3.2
     16   1.62            1.51                   0.85                       68 (int4 fp32 x)
     64   3.28            5.75                   3.41
  - torch's fp32-activation paths of both kernels are scalar fallbacks, 5-40x slower: the kernels
    are always fed bf16 activations (the cast both ways is included above) with bf16 scales;
  - M <= threshold: the integer kernel. Above it, dequantize the weight to the model dtype for this
    call and run F.linear: the call is compute-bound, so the extra pass over the weight is cheap,
    and no dense copy is kept (that would defeat the memory saving). Crossovers (kernel vs dequantize
    + F.linear, gate_up / down): int8 between 32 and 64 rows -> 32; int4 between 128 and 256 -> 128
    (its dequantize also unpacks nibbles). So decode batches use the kernels, prefill chunks do not.
  - int4 group size 64 (128 does not divide SmolLM2's 576; 32 costs the same time but twice the
    scales); a layer with K % 64 != 0 uses 32; a layer the int4 kernel cannot take (N % 16 != 0,
    e.g. Qwen3.5's in_proj_ba with few heads) stays dense.
  - lm_head is quantized: at M=1 it is the largest single matrix (49152x576 on SmolLM2): fp32 8.2 ms,
    int8 4.0 ms, int4 2.1 ms; it always uses the kernel (LM_HEAD_KERNEL_MAX_ROWS). With tied embeddings the
    embedding keeps the dense tensor, so memory then grows by the quantized lm_head copy, while decode still reads
    fewer bytes.
The output always has the input's (model) dtype.

int8 on a CPU with the C++ kernels, fp32 or bf16 model: `GridInt8Linear` instead, W ~= d * q per block of 32 inputs
(GGUF Q8_0's grid, 1.125 bytes a weight) on csrc/q8_linear_cpu.cpp's tiles; in a bf16 model on vdpbf16ps at every
batch size. torch's int8 kernel, which `--quantization int8` took until session 34, was slower than the unquantized
bf16 tile there from one row on (see GridInt8Linear; a layer it cannot take, K not a multiple of 32, keeps it).

int4 on a CPU with the C++ kernels (AVX-512 or AVX2 tiles), fp32 or bf16 model: `GridInt4Linear` instead (a bf16
model's int4 layers took torch's kernel until session 21: 1.5-3x slower, see GridInt4Linear), W ~= d * q + m per
group of GRID_GROUP inputs with fp32 d and m, kept in the 4-bit panel layout of csrc/q4_linear_cpu.cpp (the kernel
a Q4_0 / Q4_1 GGUF's layers use, layers/compact_linear.py) and multiplied with fp32 sums (an fp32 model's
activations are not rounded to bf16), and every layer shape fits (N is padded to the 32-row panel, so Qwen3.5's
in_proj_ba is quantized too). 0.625 bytes a weight (0.5 for q, 0.125 for d and m); llama.cpp's Q4_0 is 0.5625.
In an fp32 model, batches of up to GRID_KERNEL_MAX_ROWS rows use the kernel, larger ones the weight dequantized
for the call + the dense GEMM (no dense copy is kept); lm_head always the kernel; a bf16 model's layers the
kernel for every batch. The crossover depends on the tiles: 256 rows
with AVX-512 (Intel Xeon); with AVX2 (AMD EPYC, Qwen3.5 shapes, kernel vs q4_unpack + oneDNN, ms) 64
rows 7.0-15.5 vs 9.0-22.3, 96 rows 10.1-22.3 vs 10.5-20.6, 128 rows 13.8-29.7 vs 12.2-28.6, 256 rows
27.7-65.4 vs 22.2-62.1: the 4-row AVX2 tile converts each nibble for 4 rows only.
"""

import functools

import torch
from torch import nn

from ascendserve.layers.compact_linear import (Q8_GROUP, KernelLinear, Q4Panels, a8_tile_name, pack_q4, pack_q8,
                                               q8_grid, round_to_grid, tile_kernels)
from ascendserve.layers.linear import dense_linear
from ascendserve.logger import init_logger

logger = init_logger(__name__)

METHODS = ("int8", "int4")
# Largest M that still uses the integer kernel (measured: see the module docstring).
INT_KERNEL_MAX_ROWS = {"int8": 32, "int4": 128}
# lm_head sees one row per sampling sequence, and dequantizing its 49152x576 weight costs ~105 ms
# (1 thread), more than the int8 kernel at 64 rows (82 ms; fp32 F.linear 38 ms): always the kernel.
LM_HEAD_KERNEL_MAX_ROWS = 1 << 30
INT4_GROUP_SIZES = (64, 32)  # preferred first; the first that divides in_features is used
INT4_BLOCK_NS = (64, 32)  # rows the CPU int4 pack interleaves: 64 on AVX-512, 32 on AVX2 (see _unpack_int4)
GRID_GROUP = 64  # inputs per (d, m) block of GridInt4Linear; 32 where 64 does not divide K
# By the tiles' fp32 lanes (16: AVX-512, 8: AVX2): above, dequantize for the call and use the dense GEMM.
GRID_KERNEL_MAX_ROWS = {16: 256, 8: 96}
# GridInt8Linear in an fp32 model, by the tiles' fp32 lanes: above, the weight dequantized for the call + the dense
# GEMM. AVX-512 measured on a Zen 4 (`benchmarks/probe_bf16_linear.py --shapes qwen --variants fp32,q8,q8deq`, ms a
# call, the kernel / dequantized + F.linear): Qwen3.5's 7168 x 1024 at 64 rows 5.28 / 13.4, 256 rows 20.7 / 26.6,
# 2048 rows about level; AVX2 not measured: torch's int8 kernel's crossover (INT_KERNEL_MAX_ROWS) kept.
INT8_GRID_KERNEL_MAX_ROWS = {16: 256, 8: 32}
# GridInt8Linear with int8 activations: from this many rows (Zen 4, Qwen3.5's 8192 x 1024 / 1024 x 3584, ms, q8_a8_linear
# / q8_linear_bf16x / the unquantized bf16 tile: 8 rows 0.36 / 0.35 / 0.36 and 0.18 / 0.14 / 0.14; 64 rows 2.10 /
# 2.93 / 2.51 and 0.94 / 1.24 / 1.05; 2048 rows 64.3 / 91.6 / 78.9 and 30.0 / 38.9 / 33.9)
INT8_A8_MIN_ROWS = 16


class WeightOnlyLinear(nn.Module):
    """y = x @ dequant(W).T + b with W stored as int8 (per-channel scale) or int4 (per-group scale/zero)."""

    def __init__(self, linear: nn.Linear, method: str, max_kernel_rows: int | None = None) -> None:
        super().__init__()
        if method not in METHODS:
            raise ValueError(f"quantization must be one of {list(METHODS)}, got {method!r}")
        self.method = method
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.out_dtype = linear.weight.dtype
        self.max_kernel_rows = INT_KERNEL_MAX_ROWS[method] if max_kernel_rows is None else max_kernel_rows
        weight = linear.weight.detach().float()
        if method == "int8":
            self._quantize_int8(weight)
        else:
            self._quantize_int4(weight)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    @staticmethod
    def supports(linear: nn.Linear, method: str) -> bool:
        """Whether the layer's shape fits the kernel (int8: K % 16 == 0, below which torch's _weight_int8pack_mm reads
        out of bounds: a crash or NaNs; int4: N % 16 == 0 and a group size dividing K)."""
        if method == "int8":
            return linear.in_features % 16 == 0
        return linear.out_features % 16 == 0 and any(linear.in_features % g == 0 for g in INT4_GROUP_SIZES)

    def _quantize_int8(self, weight: torch.Tensor) -> None:
        # Symmetric per output channel: W[n, :] ~= q[n, :] * scale[n], q in [-127, 127].
        # The scale is rounded to bf16 (the kernel's dtype) before quantizing, so q absorbs the rounding.
        scale = (weight.abs().amax(dim=1) / 127).clamp(min=1e-12).to(torch.bfloat16).float()
        self.qweight = nn.Parameter((weight / scale[:, None]).round().clamp(-127, 127).to(torch.int8),
                                    requires_grad=False)
        self.scales = nn.Parameter(scale.to(torch.bfloat16), requires_grad=False)

    def _quantize_int4(self, weight: torch.Tensor) -> None:
        # Asymmetric per group of `group_size` inputs: W ~= (q - 8) * scale + zero, q in [0, 15]
        # (the dequantization `_weight_int4pack_mm_for_cpu` computes).
        n, k = weight.shape
        self.group_size = next(g for g in INT4_GROUP_SIZES if k % g == 0)
        groups = weight.reshape(n, k // self.group_size, self.group_size)
        lo, hi = groups.amin(-1), groups.amax(-1)
        # scale and zero are rounded to bf16 (the kernel's dtype) before quantizing, so q absorbs it.
        scale = ((hi - lo) / 15).clamp(min=1e-12).to(torch.bfloat16).float()
        zero = (lo + 8 * scale).to(torch.bfloat16).float()
        q = ((groups - zero[..., None]) / scale[..., None] + 8).round().clamp(0, 15).to(torch.int32).reshape(n, k)
        scales_zeros = torch.stack([scale.t(), zero.t()], dim=-1).contiguous()  # [K/G, N, 2]
        self.qweight = nn.Parameter(torch._convert_weight_to_int4pack_for_cpu(q, 2), requires_grad=False)
        self.scales = nn.Parameter(scales_zeros.to(torch.bfloat16), requires_grad=False)
        # The dequantize path needs the pack layout; if this build packs differently, stay on the kernel.
        self.can_unpack = torch.equal(_unpack_int4(self.qweight, n, k), q.to(torch.uint8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, self.in_features)
        if x.shape[0] <= self.max_kernel_rows or (self.method == "int4" and not self.can_unpack):
            out = self._kernel(x.to(torch.bfloat16)).to(self.out_dtype)
            if self.bias is not None:
                out = out + self.bias
        else:
            out = dense_linear(x, self.dequantize(self.out_dtype), self.bias)
        return out.reshape(*shape[:-1], self.out_features)

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        if self.method == "int8":
            return torch._weight_int8pack_mm(x, self.qweight, self.scales)
        return torch._weight_int4pack_mm_for_cpu(x, self.qweight, self.group_size, self.scales)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense [N, K] weight this layer multiplies by."""
        if self.method == "int8":
            return self.qweight.to(dtype) * self.scales.to(dtype)[:, None]
        q = _unpack_int4(self.qweight, self.out_features, self.in_features).to(dtype)
        groups = q.view(self.out_features, -1, self.group_size)
        scale, zero = self.scales.to(dtype).transpose(0, 1).contiguous().unbind(-1)  # [N, K/G] each
        return torch.addcmul((zero - 8 * scale)[..., None], groups, scale[..., None]).reshape(
            self.out_features, self.in_features)

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.method == "int4" else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, method={self.method}{group}"


class GridQuantLinear(KernelLinear):
    """What GridInt4Linear and GridInt8Linear share: an fp32 or bf16 CPU layer's weight rounded onto a grid per
    block of inputs and multiplied by the C++ kernels with fp32 sums. A bf16 layer (`bf16_io`) runs its kernel for
    every batch, rounding to bf16 once unless fp32_out (the lm_head, and the layers a model names in its
    `fp32_output_linears`, as Bf16Linear.for_bf16); an fp32 layer up to max_rows rows (by the tiles' fp32 lanes,
    `rows_by_lanes`), the weight dequantized for the call above."""

    def __init__(self, linear: nn.Linear, kernels, rows_by_lanes: dict[int, int], max_rows: int | None,
                 fp32_out: bool) -> None:
        super().__init__(linear, kernels)
        self.bf16_io = linear.weight.dtype == torch.bfloat16
        self.fp32_out = fp32_out and self.bf16_io
        self.max_rows = rows_by_lanes[kernels.tile_lanes()] if max_rows is None else max_rows
        if self.bf16_io:
            self.max_rows = 1 << 62  # one kernel for every batch
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        if self.bias is not None and self.bf16_io:
            self.register_buffer("bias_fp32", self.bias.detach().float(), persistent=False)

    @staticmethod
    def supports(linear: nn.Linear) -> bool:
        """An fp32 or bf16 CPU layer with in_features a multiple of 32, on a CPU where the kernels built."""
        weight = linear.weight
        return (weight.dtype in (torch.float32, torch.bfloat16) and weight.device.type == "cpu"
                and linear.in_features % 32 == 0 and tile_kernels() is not None)

    def kernel_bias(self) -> torch.Tensor | None:
        """The bias as the kernels add it (fp32)."""
        return self.bias_fp32 if self.bf16_io and self.bias is not None else self.bias

    def _large(self, x: torch.Tensor) -> torch.Tensor:
        return dense_linear(x, self.dequantize(), self.bias)


class GridInt4Linear(Q4Panels, GridQuantLinear):
    """int4 on CPU: W ~= d * q + m per group of inputs, q in 0..15, fp32 d and m, fp32 sums.

    Asymmetric round-to-nearest per group (d = (max - min) / 15, m = min), like llama.cpp's Q4_1 but
    with fp32 d and m and GRID_GROUP inputs. An fp32 layer: batches of up to max_rows rows run
    csrc/q4_linear_cpu.cpp's fp32 kernel on the 4-bit panels, larger ones multiply the weight it dequantizes for
    the call (q4_unpack) with F.linear. A bf16 layer (a model run in bf16, `bf16_io`): q4_linear_bf16x for every
    batch, bf16 x on the same panels (vdpbf16ps where the CPU has AVX512-BF16: q exact in bf16, exact products,
    fp32 sums), rounded to bf16 once unless fp32_out (the lm_head, and the layers a model names in its
    `fp32_output_linears`, as Bf16Linear.for_bf16). Every batch size on one kernel, so a row's result does not
    depend on its batch; measured (Zen 5, 2 threads, weights from DRAM, benchmarks/probe_bf16_linear.py, ms per
    call) q4_linear_bf16x / q4_linear on fp32 x / torch's _weight_int4pack_mm_for_cpu on bf16 x / the unquantized
    bf16 tile:
          shape (N x K)          M=1                     M=64                    M=2048
          Qwen3.5 8192x1024      0.12/0.22/0.22/0.64     1.87/3.44/4.84/1.97     64.4/127/150/58.7
          Qwen3.5 1024x3584      0.05/0.08/0.09/0.14     0.72/1.40/2.04/0.68     22.3/47.5/65.5/20.4
          Qwen3.5 248320x1024    4.96/5.22/5.79/13.1     51.2/101/164/44.1
    At prefill sizes the kernel is within 10-25% of the unquantized bf16 tile: no dequantized path there.
    """

    weight_format = "int4 grid"

    def __init__(self, linear: nn.Linear, kernels, max_rows: int | None = None, fp32_out: bool = False) -> None:
        super().__init__(linear, kernels, GRID_KERNEL_MAX_ROWS, max_rows, fp32_out)
        weight = linear.weight.detach().float()
        n, k = weight.shape
        self.group_size = GRID_GROUP if k % GRID_GROUP == 0 else 32
        blocks = weight.reshape(n, k // self.group_size, self.group_size)
        lo, hi = blocks.amin(-1), blocks.amax(-1)
        d = (hi - lo) / 15
        q = round_to_grid(blocks, d, lo).to(torch.uint8).reshape(n, k)
        q, scales, mins = pack_q4(q, d, lo)
        self.register_buffer("q", q, persistent=False)
        self.register_buffer("scales", scales, persistent=False)
        self.register_buffer("mins", mins, persistent=False)

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        if not self.bf16_io:
            return super()._kernel(x)
        bias = self.kernel_bias()
        if self.int8_activations and x.shape[0] > 1:  # the int8-activation kernel reads fp32 x (exact from bf16)
            out = self.kernels.q4_a8_linear(x.float(), self.q, self.scales, self.mins, self.out_features, bias)
            return out if self.fp32_out else out.bfloat16()
        return self.kernels.q4_linear_bf16x(x, self.q, self.scales, self.mins, self.out_features, bias,
                                            not self.fp32_out)

    def dequantize(self) -> torch.Tensor:
        """The dense fp32 [N, K] weight this layer multiplies by."""
        return self.kernels.q4_unpack(self.q, self.scales, self.mins, self.out_features)

    def extra_repr(self) -> str:
        rows = "" if self.int8_activations or self.bf16_io else f", kernel up to {self.max_rows} rows"
        out = ", fp32 out" if self.fp32_out else ""
        return super().extra_repr() + f", group_size={self.group_size}{rows}{out}"


class GridInt8Linear(GridQuantLinear):
    """int8 on CPU: W ~= d * q per block of Q8_GROUP inputs, q in -127..127 and an fp32 d (q8_grid), kept in the
    8-bit panel layout of csrc/q8_linear_cpu.cpp (the kernel a Q8_0 GGUF's layers use, Q8Linear) and multiplied with
    fp32 sums. 1.125 bytes a weight. A bf16 layer (a model run in bf16, `bf16_io`): q8_linear_bf16x for every batch,
    bf16 x on the same panels (vdpbf16ps where the CPU has AVX512-BF16: q exact in bf16, exact products, fp32 sums),
    rounded to bf16 once unless fp32_out (the lm_head, and the layers a model names in its `fp32_output_linears`,
    as GridInt4Linear). An fp32 layer: q8_linear up to max_rows rows, larger batches the weight dequantized for the
    call + the dense GEMM (no dense copy is kept; the fp32 tile widens each byte per tile of rows). Measured on a
    Zen 4 (AVX512-BF16, 2 threads, weights from DRAM, `benchmarks/probe_bf16_linear.py --shapes qwen --variants
    bf16x,q8,q8bf16x,i8torch,q4bf16x`, median ms a call) q8_linear_bf16x / q8_linear on fp32 x / torch's
    _weight_int8pack_mm on bf16 x (what `--quantization int8` ran before, per-channel scales) / the unquantized bf16
    tile:
          shape (N x K)          M=1                     M=8                     M=64                    M=2048
          Qwen3.5 8192x1024      0.17/0.30/0.56/0.48     0.33/0.85/1.47/0.57     2.86/5.99/7.53/2.50     90.3/191/225/79.6
          Qwen3.5 1024x3584      0.08/0.13/0.18/0.21     0.14/0.38/0.47/0.21     1.23/2.56/2.98/1.10     38.3/81.6/91.8/33.9
          Qwen3.5 248320x1024    6.20/6.26/16.5/9.41     10.6/24.1/50.7/12.1     88.5/182/367/76.7       2771/5780/11225/2412
    """

    weight_format = f"int8 grid per {Q8_GROUP} inputs"
    int8_activations = False

    def __init__(self, linear: nn.Linear, kernels, max_rows: int | None = None, fp32_out: bool = False) -> None:
        super().__init__(linear, kernels, INT8_GRID_KERNEL_MAX_ROWS, max_rows, fp32_out)
        q, scales = pack_q8(*q8_grid(linear.weight.detach()))
        self.register_buffer("q", q, persistent=False)
        self.register_buffer("scales", scales, persistent=False)

    def use_int8_activations(self) -> bool:
        """--activation-quantization int8 (opt-in, not bit-exact): from INT8_A8_MIN_ROWS rows, x rounded to int8 per
        32 inputs (llama.cpp's Q8_1, as Q4Panels) times the 8-bit weights in integer sums on AVX512-VNNI's vpdpbusd
        (q8_a8_linear); every batch on the kernels. False, and nothing changes, where this build has no VNNI tile
        (AVX2's vpmaddubsw would overflow its 16-bit pair sums on 8-bit weights)."""
        if self.kernels.q4_a8_tile() != "avx512_vnni":
            return False
        self.int8_activations = True
        self.max_rows = 1 << 62
        self.weight_format = f"{self.weight_format}, int8 activations per 32 inputs from {INT8_A8_MIN_ROWS} rows"
        return True

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        if self.int8_activations and x.shape[0] >= INT8_A8_MIN_ROWS:
            out = self.kernels.q8_a8_linear(x.float(), self.q, self.scales, self.out_features, self.kernel_bias())
            return out.to(torch.bfloat16) if self.bf16_io and not self.fp32_out else out
        if not self.bf16_io:
            return self.kernels.q8_linear(x, self.q, self.scales, self.out_features, self.bias)
        return self.kernels.q8_linear_bf16x(x, self.q, self.scales, self.out_features, self.kernel_bias(),
                                            not self.fp32_out)

    def dequantize(self) -> torch.Tensor:
        """The dense fp32 [N, K] weight this layer multiplies by."""
        weight = self.q.float() * self.scales.repeat_interleave(Q8_GROUP, dim=1)  # [N/32, K, 32]
        return weight.transpose(1, 2).reshape(-1, self.in_features)[:self.out_features]

    def extra_repr(self) -> str:
        rows = "" if self.bf16_io else f", kernel up to {self.max_rows} rows"
        out = ", fp32 out" if self.fp32_out else ""
        return super().extra_repr() + rows + out


def _unpack_int4(packed: torch.Tensor, n: int, k: int, block_n: int | None = None) -> torch.Tensor:
    """q [N, K] (uint8, 0..15) from `_convert_weight_to_int4pack_for_cpu`'s layout (torch 2.13, x86).

    Rows go in blocks of B (64 where torch runs its AVX-512 kernels, 32 on AVX2: `_int4_block_n`), then
    one tail block of the remaining N % B rows (a multiple of 16). A block of b rows is stored as K runs
    of b/2 bytes, flattened over its packed rows. In a full block, byte j of run k holds (row j, k) in
    its low nibble and (row j + B/2, k) in its high nibble; in the tail block, rows 2j and 2j + 1. E.g.
    B=64, N=64: (n=33, k=0) is the high nibble of byte 1 of run 0; N=48: (n=1, k=0) is byte 0's high
    nibble and (n=0, k=1) is byte 24's low nibble. The layer checks this against its own q at
    quantization time (`can_unpack`).
    """
    block_n = block_n or _int4_block_n()
    flat = packed.reshape(-1)
    full = n // block_n * block_n
    blocks = flat[:full * k // 2].view(-1, k, block_n // 2)
    out = [torch.cat([blocks & 15, blocks >> 4], dim=2).transpose(1, 2).reshape(full, k)]
    if n > full:
        tail = flat[full * k // 2:].view(k, (n - full) // 2)
        out.append(torch.stack([tail & 15, tail >> 4], dim=2).view(k, n - full).t())
    return torch.cat(out) if n > full else out[0]


@functools.cache
def _int4_block_n() -> int:
    """The row block of this CPU's int4 pack (torch picks it by the instruction set it runs), found by
    packing a probe; INT4_BLOCK_NS[0] when none matches (`can_unpack` then keeps the kernel)."""
    probe = torch.randint(0, 16, (64, 32), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    packed = torch._convert_weight_to_int4pack_for_cpu(probe, 2)
    return next((b for b in INT4_BLOCK_NS if torch.equal(_unpack_int4(packed, 64, 32, b), probe.to(torch.uint8))),
                INT4_BLOCK_NS[0])


def quantize_model_(model: nn.Module, method: str, int8_activations: bool = False) -> dict[str, int]:
    """Replace the model's nn.Linear layers by WeightOnlyLinear in place; returns counts and bytes.

    Layers whose shape the kernel cannot take (int4: out_features % 16 != 0, e.g. Qwen3.5's
    in_proj_ba with few heads) stay dense. int8_activations: GridInt4Linear layers multiply int8-rounded
    activations (Q4Panels; counted as "int8_activations"). Call after the weights are loaded.
    """
    if method not in METHODS:
        raise ValueError(f"quantization must be one of {list(METHODS)}, got {method!r}")
    before = _weight_bytes(model)
    quantized = skipped = a8 = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            rows = LM_HEAD_KERNEL_MAX_ROWS if name == "lm_head" else None
            if method == "int4" and GridInt4Linear.supports(child):
                fp32_out = name == "lm_head" or name in getattr(parent, "fp32_output_linears", ())
                layer = GridInt4Linear(child, tile_kernels(), rows, fp32_out=fp32_out)
                if int8_activations:
                    layer.use_int8_activations()
                    a8 += 1
                setattr(parent, name, layer)
                quantized += 1
            elif method == "int8" and GridInt8Linear.supports(child):
                fp32_out = name == "lm_head" or name in getattr(parent, "fp32_output_linears", ())
                layer = GridInt8Linear(child, tile_kernels(), rows, fp32_out=fp32_out)
                if int8_activations and layer.use_int8_activations():
                    a8 += 1
                setattr(parent, name, layer)
                quantized += 1
            elif WeightOnlyLinear.supports(child, method):
                setattr(parent, name, WeightOnlyLinear(child, method, rows))
                quantized += 1
            else:
                skipped += 1
    stats = {"quantized": quantized, "skipped": skipped, "bytes_before": before, "bytes_after": _weight_bytes(model),
             "int8_activations": a8}
    logger.info("Weight-only %s quantization: %d linear layers quantized (%d left dense: shape not supported), "
                "weights %.1f MiB -> %.1f MiB (not bit-exact)", method, quantized, skipped,
                before / 2**20, stats["bytes_after"] / 2**20)
    if a8:
        logger.info("%d %s layers multiply int8 activations (--activation-quantization int8; %s)", a8, method,
                    a8_tile_name(tile_kernels()))
    return stats


def _weight_bytes(model: nn.Module) -> int:
    """Bytes of the parameters and buffers (GridInt4Linear keeps its 4-bit weight as buffers), each
    storage once: tied tensors (embed_tokens / lm_head) count once."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total
