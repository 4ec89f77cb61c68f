"""fp32 linear layers for CPU decode: an MKL pre-packed weight, or a bf16 / 4-bit stored one (Bf16Linear, Q4Linear).

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
checkpoint (or a dequantized GGUF) keeps the MKL path. Measured like benchmarks/probe_bf16_linear.py
(2 threads, weights streamed from DRAM, ms per call), fp32 F.linear / MKL pack / this kernel:
      shape (N x K)            M=1               M=8               M=64              M=256
      Qwen3.5 8192x1024        1.52/2.14/0.58    4.85/2.54/1.58    8.25/5.99/7.23    23.6/-/28.0
      Qwen3.5 1024x3584        0.40/0.49/0.18    1.11/0.63/0.41    3.27/2.80/2.76    10.0/-/10.4
      SmolLM2 49152x576        5.60/5.72/3.34    21.7/7.41/5.38    27.0/18.7/23.2    109/-/117
Above BF16_KERNEL_MAX_ROWS (prefill chunks, compute-bound) the layer widens the whole weight to fp32
for that call and runs F.linear: MKL's GEMM is 10-30% faster there than the kernel, and the widening
(a few ms per layer) is small beside it. ASCENDSERVE_COMPACT_WEIGHTS=0 keeps such layers in fp32.

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

import functools
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from ascendserve.config import env_switch
from ascendserve.logger import init_logger

logger = init_logger(__name__)

ENV_VAR = "ASCENDSERVE_PACKED_LINEAR"
ONEDNN_ENV_VAR = "ASCENDSERVE_ONEDNN_LINEAR"  # 1 / 0: oneDNN's / MKL's fp32 GEMM; unset: the faster (probed)
ONEDNN_MARGIN = 0.9  # oneDNN is chosen when its probe time is below this share of MKL's
COMPACT_ENV_VAR = "ASCENDSERVE_COMPACT_WEIGHTS"  # 0: bf16- and 4-bit-valued weights stay fp32
PANEL_ROWS = 32  # output rows per panel of the bf16 and 4-bit packs (csrc/*_linear_cpu.cpp)
BF16_KERNEL_MAX_ROWS = 256  # above, widen the weight for the call and use F.linear (see the docstring)
Q4_GROUP = 32  # inputs per (d, m) block of the 4-bit grid (csrc/q4_linear_cpu.cpp), GGUF's block size
Q4_KERNEL_MAX_ROWS = 32  # above, the fp32 layer (MKL): see Q4Linear
Q8_GROUP = 32  # inputs per d of the 8-bit grid (csrc/q8_linear_cpu.cpp), GGUF Q8_0's block size
Q8_KERNEL_MAX_ROWS = 24  # above, the fp32 layer (MKL): see Q8Linear
PACK_ROWS = 64  # the m each weight is packed for
MIN_PACKED_ROWS = 4  # below, F.linear (MKL's gemv) was as fast, or faster for K >= 1024
MAX_PACKED_ROWS = 128  # above, F.linear was as fast or faster (prefill)


@functools.cache
def onednn_gemm_faster() -> bool:
    """Whether fp32 CPU linears multiply with oneDNN's GEMM rather than MKL's: ASCENDSERVE_ONEDNN_LINEAR
    when set, else whether oneDNN ran a probe GEMM (256 x 1024 by 2048 x 1024) in under ONEDNN_MARGIN
    of MKL's time, both timed in turn, once per process. On an AMD EPYC (AVX2) oneDNN was 1.2-1.9x
    faster from 32 rows on (the demo's shapes: 117-123 vs 90-100 GFLOP/s at 2048 rows, its lm_head at 64
    rows 40 vs 79 ms); on the Intel Xeons of earlier runs MKL's GEMM ran near the cores' peak."""
    available = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    forced = env_switch(ONEDNN_ENV_VAR)
    if forced is not None or not available:
        return bool(forced) and available
    x, weight = torch.randn(256, 1024), torch.randn(2048, 1024) * 0.03
    gemms = {"MKL": lambda: F.linear(x, weight), "oneDNN": lambda: _onednn_linear(x, weight, None)}
    times: dict[str, list[float]] = {name: [] for name in gemms}
    for rep in range(6):  # the first round warms both up and is not counted
        for name, gemm in gemms.items():
            start = time.perf_counter()
            gemm()
            if rep:
                times[name].append(time.perf_counter() - start)
    mkl, onednn = (statistics.median(times[name]) * 1e3 for name in ("MKL", "oneDNN"))
    faster = onednn < ONEDNN_MARGIN * mkl
    logger.info("fp32 GEMM probe (256 x 1024 by 2048 x 1024): oneDNN %.2f ms, MKL %.2f ms: %s for fp32 linears; "
                "%s=0/1 picks one", onednn, mkl, "oneDNN" if faster else "MKL", ONEDNN_ENV_VAR)
    return faster


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), through oneDNN's GEMM for fp32 CPU tensors where onednn_gemm_faster()
    (a compiled forward keeps F.linear, which inductor lowers itself)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if (rows and x.dtype == weight.dtype == torch.float32 and x.device.type == "cpu"
            and not torch.compiler.is_compiling() and onednn_gemm_faster()):
        out = _onednn_linear(x.reshape(rows, x.shape[-1]).contiguous(), weight, bias)
        return out.reshape(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


class DenseLinear(nn.Module):
    """y = x @ W.T + b on an fp32 CPU weight by dense_linear (oneDNN's GEMM): what an nn.Linear becomes
    where oneDNN's GEMM measured faster than MKL's (MKL's pack, PackedLinear, is then not made)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # the same Parameter: ties (embedding / lm_head) survive
        self.register_parameter("bias", linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense_linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


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
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, " \
               f"weight={self.weight_format} (fp32 compute)"


class Bf16Linear(KernelLinear):
    """y = x @ W.T + b, fp32 in and out, with W held as bf16 panels (exact for a bf16-valued weight)."""

    max_rows = BF16_KERNEL_MAX_ROWS
    weight_format = "bf16"

    def __init__(self, linear: nn.Linear, kernels) -> None:
        super().__init__(linear, kernels)
        self.register_parameter("bias", linear.bias)
        self.register_buffer("packed", pack_bf16(linear.weight.detach()), persistent=False)

    @staticmethod
    def supports(linear: nn.Linear) -> bool:
        """fp32 on CPU, in_features even, and every weight value exactly representable in bf16."""
        weight = linear.weight
        return (weight.dtype == torch.float32 and weight.device.type == "cpu" and linear.in_features % 2 == 0
                and bf16_valued(weight))

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.bf16_linear(x, self.packed, self.out_features, self.bias)

    def _large(self, x: torch.Tensor) -> torch.Tensor:
        # Compute-bound: a GEMM on the weight widened for this call beats the kernel there.
        return dense_linear(x, self.kernels.bf16_unpack(self.packed, self.out_features), self.bias)


class GridLinear(KernelLinear):
    """A compact copy of an fp32 layer whose values lie on a grid, for batches of up to max_rows rows;
    larger batches run the fp32 layer it wraps (`dense`: a PackedLinear, or the nn.Linear)."""

    def __init__(self, dense: nn.Module, kernels) -> None:
        super().__init__(dense, kernels)
        self.dense = dense

    @property
    def bias(self) -> torch.Tensor | None:
        return self.dense.bias

    def _large(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense(x)


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

    Larger batches run the fp32 layer it wraps (`dense`: a PackedLinear, or the nn.Linear): there
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


def compact_embeddings_(model: nn.Module) -> int:
    """Replace the model's fp32 CPU nn.Embedding layers whose values are all bf16 by Bf16Embedding, in place,
    where no other layer holds the same weight (a tied lm_head that stayed fp32 would keep it alive, and the
    bf16 copy would add memory); returns the bytes freed. Qwen3.5-0.8B's 248320 x 1024 table, tied to an
    lm_head that prepack_linears_ keeps as bf16 panels (or --quantization int4 as 4-bit): 1017 -> 509 MB.
    A no-op where ASCENDSERVE_COMPACT_WEIGHTS=0. Call after prepack_linears_ / quantize_model_."""
    if env_switch(COMPACT_ENV_VAR) is False:
        return 0
    embeddings = [(parent, name, child) for parent in list(model.modules())
                  for name, child in parent.named_children() if type(child) is nn.Embedding]
    tables = {child.weight.data_ptr() for _, _, child in embeddings}
    held_elsewhere = {t.data_ptr() for module in model.modules() if type(module) is not nn.Embedding
                      for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]} & tables
    freed = 0
    with torch.no_grad():
        for parent, name, child in embeddings:
            weight = child.weight
            if (weight.dtype != torch.float32 or weight.device.type != "cpu" or child.max_norm is not None
                    or weight.data_ptr() in held_elsewhere or not bf16_valued(weight)):
                continue
            setattr(parent, name, Bf16Embedding(child))
            freed += weight.numel() * 2
    if freed:
        logger.info("The token embedding holds bf16 values (a bf16 checkpoint): kept as bf16 (%.1f MiB freed); "
                    "%s=0 keeps it fp32", freed / 2**20, COMPACT_ENV_VAR)
    return freed


def pack_bf16(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] -> [ceil(N/32), K/2, 32, 2] bf16: panels of 32 rows, each input pair of a row side by side."""
    n, k = weight.shape
    panels = -(-n // PANEL_ROWS)
    padded = torch.zeros(panels * PANEL_ROWS, k, dtype=torch.bfloat16)
    padded[:n] = weight
    return padded.view(panels, PANEL_ROWS, k // 2, 2).permute(0, 2, 1, 3).contiguous()


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
    that value is d * +-127 and d is found from it. A block fits when every value is reproduced to 2^-20
    of its largest magnitude (in practice exactly); one block that does not and the layer stays as it is.
    """
    n, k = weight.shape
    if k % Q8_GROUP:
        return None
    qs, ds = [], []
    for start in range(0, n, rows_per_pass):
        blocks = weight[start:start + rows_per_pass].reshape(-1, k // Q8_GROUP, Q8_GROUP)
        amax = blocks.abs().amax(-1)
        d = amax / 127
        q = (blocks / torch.where(d == 0, torch.ones_like(d), d)[..., None]).round_()
        if not bool(_reproduces(blocks, q * d[..., None]).all()):
            return None
        qs.append(q.to(torch.int8).reshape(-1, k))
        ds.append(d)
    return torch.cat(qs), torch.cat(ds)


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


def prepack_linears_(model: nn.Module, int8_activations: bool = False) -> dict[str, int]:
    """Replace the model's fp32 CPU nn.Linear layers in place; returns counts and bytes.

    All bf16 values -> Bf16Linear. Else DenseLinear where oneDNN's GEMM is the faster
    (onednn_gemm_faster), or PackedLinear (MKL's packed GEMM, unless ASCENDSERVE_PACKED_LINEAR=0),
    wrapped in a Q4Linear for small batches when the values are a 4-bit grid per 32 inputs (a
    dequantized Q4_0 / Q4_1 GGUF), or in a Q8Linear when they are an 8-bit one (Q8_0). Bf16Linear,
    Q4Linear and Q8Linear need the CPU kernels and ASCENDSERVE_COMPACT_WEIGHTS not 0. int8_activations: the
    Q4Linear layers multiply int8-rounded activations (Q4Panels; counted as "int8_activations"). A no-op (zeros)
    where none applies, e.g. bf16 or non-CPU layers (the GEMM probe then does not run either). Call after
    the weights are loaded.
    """
    stats = {"packed": 0, "weight_bytes": 0, "pack_bytes": 0, "padded": 0, "bf16": 0, "bf16_bytes": 0,
             "q4": 0, "q4_bytes": 0, "q8": 0, "q8_bytes": 0, "onednn": 0, "int8_activations": 0}
    compact, mkl = env_switch(COMPACT_ENV_VAR) is not False, packing_supported()
    any_rows_by_shape: dict[tuple[int, int], bool] = {}
    with torch.no_grad():
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if not isinstance(child, nn.Linear) or not PackedLinear.supports(child):
                    continue
                if compact and Bf16Linear.supports(child) and (kernels := tile_kernels()) is not None:
                    layer = Bf16Linear(child, kernels)
                    stats["bf16"] += 1
                    stats["bf16_bytes"] += layer.packed.numel() * 2
                    setattr(parent, name, layer)
                    continue
                kernels = tile_kernels() if compact else None
                grid4 = find_q4_grid(child.weight.detach()) if kernels is not None else None
                if grid4 is not None and int8_activations:  # the kernels take every batch: no fp32 layer
                    layer = Q4Linear(child, grid4, kernels)
                    layer.use_int8_activations()
                    stats["int8_activations"] += 1
                    stats["q4"] += 1
                    stats["q4_bytes"] += layer.q4_bytes()
                    setattr(parent, name, layer)
                    continue
                layer = child
                if onednn_gemm_faster():  # probed once: here, or at a bf16 layer's first large batch
                    layer = DenseLinear(child)
                    stats["onednn"] += 1
                elif mkl:
                    shape = tuple(child.weight.shape)
                    layer = PackedLinear(child, any_rows_by_shape.get(shape))
                    any_rows_by_shape[shape] = layer.any_rows
                    stats["packed"] += 1
                    stats["padded"] += not layer.any_rows
                    stats["weight_bytes"] += child.weight.numel() * child.weight.element_size()
                    stats["pack_bytes"] += layer.pack_bytes()
                if grid4 is not None:
                    layer = Q4Linear(layer, grid4, kernels)
                    stats["q4"] += 1
                    stats["q4_bytes"] += layer.q4_bytes()
                elif kernels is not None and (grid := find_q8_grid(child.weight.detach())) is not None:
                    layer = Q8Linear(layer, grid, kernels)
                    stats["q8"] += 1
                    stats["q8_bytes"] += sum(t.numel() * t.element_size() for t in (layer.q, layer.scales))
                if layer is not child:
                    setattr(parent, name, layer)
    if stats["bf16"]:
        logger.info("%d fp32 linear layers hold bf16 values (a bf16 checkpoint): kept as bf16 (%.1f MiB, half "
                    "the fp32 size) and multiplied in fp32 by the CPU kernel; %s=0 keeps them fp32",
                    stats["bf16"], stats["bf16_bytes"] / 2**20, COMPACT_ENV_VAR)
    if stats["int8_activations"]:
        logger.info("%d fp32 linear layers hold a 4-bit grid per %d inputs (a Q4_0 / Q4_1 GGUF): kept as 4-bit "
                    "only (%.1f MiB, the fp32 weights released), multiplied with int8 activations in batches of "
                    "2 rows or more (--activation-quantization int8, not bit-exact), in fp32 at one row",
                    stats["q4"], Q4_GROUP, stats["q4_bytes"] / 2**20)
    elif stats["q4"]:
        logger.info("%d fp32 linear layers hold a 4-bit grid per %d inputs (a Q4_0 / Q4_1 GGUF): also kept as "
                    "4-bit (%.1f MiB more) for batches of up to %d rows, multiplied in fp32 by the CPU kernel; "
                    "%s=0 turns this off", stats["q4"], Q4_GROUP, stats["q4_bytes"] / 2**20, Q4_KERNEL_MAX_ROWS,
                    COMPACT_ENV_VAR)
    if stats["q8"]:
        logger.info("%d fp32 linear layers hold an 8-bit grid per %d inputs (Q8_0 GGUF tensors): also kept as "
                    "8-bit (%.1f MiB more) for batches of up to %d rows, multiplied in fp32 by the CPU kernel; "
                    "%s=0 turns this off", stats["q8"], Q8_GROUP, stats["q8_bytes"] / 2**20, Q8_KERNEL_MAX_ROWS,
                    COMPACT_ENV_VAR)
    if stats["packed"]:
        rows = f"{MIN_PACKED_ROWS}..{MAX_PACKED_ROWS} rows" if not stats["padded"] else \
            f"{MIN_PACKED_ROWS}..{PACK_ROWS} rows padded to {PACK_ROWS} on {stats['padded']} layers (this MKL needs it)"
        logger.info("MKL-packed %d fp32 linear layers for batches of %s (F.linear outside): about %.1f MiB "
                    "more memory (%.1f MiB reserved); ASCENDSERVE_PACKED_LINEAR=0 turns this off",
                    stats["packed"], rows, stats["weight_bytes"] / 2**20, stats["pack_bytes"] / 2**20)
    return stats


def tile_kernels():
    """The CPU kernel namespace, None when they are turned off or did not build (cpu_kernels warns), or
    when this CPU has neither AVX-512 nor AVX2 with FMA: the kernels' portable loops would be slower than
    MKL's fp32 GEMM."""
    from ascendserve.layers import cpu_kernels
    kernels = cpu_kernels.ops()
    return kernels if kernels is not None and kernels.simd_tiles() else None
