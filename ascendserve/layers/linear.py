"""fp32 linear layers for CPU: the weight in panels for the C++ GEMM (PanelLinear), an MKL pre-packed weight
(PackedLinear) or oneDNN's GEMM (DenseLinear); fp32_gemm() probes which of the three a process uses, and
large_batch_gemm() which one batches of LARGE_ROWS rows or more (prefill steps) use.

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

The layers that keep a bf16, 4-bit or 8-bit copy of a weight are in compact_linear.py; prepack.py gives
each of a model's layers its form.
"""

import functools
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

from ascendserve.config import env_switch
from ascendserve.logger import init_logger

logger = init_logger(__name__)

ENV_VAR = "ASCENDSERVE_PACKED_LINEAR"
FP32_GEMM_ENV_VAR = "ASCENDSERVE_FP32_GEMM"  # panel / onednn / mkl: that GEMM; unset: the fastest (probed)
FP32_GEMMS = ("panel", "onednn", "mkl")
PROBE_ROWS = (64, 256)  # the probe's batches: a decode step's and a small prefill chunk's
LARGE_ROWS = 512  # batches of this many rows or more multiply with the GEMM a second probe picks (large_batch_gemm)
LARGE_PROBE_ROWS = (1024,)  # that probe's batch: a prefill step's
PACK_ROWS = 64  # the m each weight is packed for
MIN_PACKED_ROWS = 4  # below, F.linear (MKL's gemv) was as fast, or faster for K >= 1024
MAX_PACKED_ROWS = 128  # above, F.linear was as fast or faster (prefill)


def forced_gemm() -> str | None:
    """ASCENDSERVE_FP32_GEMM's value (None when unset); ValueError for one outside FP32_GEMMS."""
    value = os.environ.get(FP32_GEMM_ENV_VAR, "").strip().lower()
    if value and value not in FP32_GEMMS:
        raise ValueError(f"{FP32_GEMM_ENV_VAR}={value!r} is not one of {', '.join(FP32_GEMMS)}")
    return value or None


def _onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _panel_ops():
    """The CPU kernels when their tiles are compiled for SIMD (compact_linear.tile_kernels), else None."""
    from ascendserve.layers.compact_linear import tile_kernels  # here: compact_linear imports this module
    return tile_kernels()


@functools.cache
def gemm_probe_ms(rows: tuple[int, ...]) -> dict[str, float]:
    """ms of each available fp32 GEMM ("panel": the C++ kernel's, on its pack; "onednn"; "mkl": F.linear) for a
    2048 x 1024 weight, summed over batches of `rows` rows: the best of 5 rounds, the GEMMs timed in turn
    (other work on the machine only slows a round down), once per process and set of rows."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(2048, 1024, generator=gen) * 0.03
    xs = [torch.randn(m, 1024, generator=gen) for m in rows]
    gemms = {"mkl": lambda x: F.linear(x, weight)}
    if _onednn_available():
        gemms["onednn"] = lambda x: _onednn_linear(x, weight, None)
    if (kernels := _panel_ops()) is not None:
        panels = kernels.f32_pack(weight)
        gemms["panel"] = lambda x: kernels.f32_linear(x, panels, weight.shape[0], None)
    times: dict[str, list[float]] = {name: [] for name in gemms}
    for rep in range(6):  # the first round warms each up and is not counted
        for name, gemm in gemms.items():
            start = time.perf_counter()
            for x in xs:
                gemm(x)
            if rep:
                times[name].append(time.perf_counter() - start)
    ms = {name: min(t) * 1e3 for name, t in times.items()}
    logger.info("fp32 GEMM probe (%s x 1024 rows by 2048 x 1024): %s; %s=%s picks one",
                " + ".join(map(str, rows)), ", ".join(f"{name} {t:.2f} ms" for name, t in ms.items()),
                FP32_GEMM_ENV_VAR, "|".join(FP32_GEMMS))
    return ms


def _fastest_gemm(rows: tuple[int, ...]) -> str:
    """ASCENDSERVE_FP32_GEMM when set (and available here), else the fastest in gemm_probe_ms(rows)."""
    forced = forced_gemm()
    if forced == "onednn" and not _onednn_available() or forced == "panel" and _panel_ops() is None:
        logger.warning("%s=%s: not available here; probing the others", FP32_GEMM_ENV_VAR, forced)
        forced = None
    if forced:
        return forced
    ms = gemm_probe_ms(rows)
    if _panel_ops() is None:  # probed before the CPU kernels were turned off (ASCENDSERVE_CPU_KERNELS=0)
        ms = {name: t for name, t in ms.items() if name != "panel"}
    return min(ms, key=ms.get)


def fp32_gemm() -> str:
    """The GEMM fp32 CPU linears multiply with (prepack.py makes their layers for it) below LARGE_ROWS rows:
    ASCENDSERVE_FP32_GEMM when set, else the fastest in gemm_probe_ms(PROBE_ROWS). On the 2-vCPU AMD EPYC (AVX2)
    the panel kernel was the fastest at every batch size up to 64 rows and level at prefill sizes
    (csrc/f32_linear_cpu.cpp), and oneDNN's 1.2-1.9x faster than MKL's from 32 rows on; on the Intel Xeons of
    earlier runs MKL's GEMM ran near the cores' peak."""
    return _fastest_gemm(PROBE_ROWS)


def large_batch_gemm() -> str:
    """The GEMM fp32 batches of LARGE_ROWS rows or more multiply with: ASCENDSERVE_FP32_GEMM when set, else the
    fastest at LARGE_PROBE_ROWS rows, which need not be fp32_gemm()'s. On a 2-vCPU Xeon without AVX512-BF16
    (session 22, benchmarks/probe_fp32_gemm.py, median GFLOP/s of the demo's and Qwen3.5's layers at 2048 rows):
    MKL 232-300, oneDNN 202-294, the panel kernel 151-228, while the small probe picked oneDNN (64 + 256 rows:
    5.82 ms, MKL 6.44, panel 6.61)."""
    return _fastest_gemm(LARGE_PROBE_ROWS)


def onednn_gemm_faster(rows: int = 1) -> bool:
    """Whether a batch of `rows` rows by a weight made for one call (widened from bf16, dequantized), or by an fp32
    weight that holds no pack (DenseLinear), multiplies with oneDNN's GEMM rather than MKL's: ASCENDSERVE_FP32_GEMM=
    onednn / mkl when set, else whether oneDNN's time is below MKL's in the probe for that size (gemm_probe_ms at
    PROBE_ROWS, or at LARGE_PROBE_ROWS from LARGE_ROWS on; the panel kernel would need a pack made per call)."""
    if not _onednn_available():
        return False
    forced = forced_gemm()
    if forced in ("onednn", "mkl"):
        return forced == "onednn"
    ms = gemm_probe_ms(LARGE_PROBE_ROWS if rows >= LARGE_ROWS else PROBE_ROWS)
    return ms["onednn"] < ms["mkl"]


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), through oneDNN's GEMM for fp32 CPU tensors where onednn_gemm_faster() at x's
    rows (a compiled forward keeps F.linear, which inductor lowers itself)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if (rows and x.dtype == weight.dtype == torch.float32 and x.device.type == "cpu"
            and not torch.compiler.is_compiling() and onednn_gemm_faster(rows)):
        out = _onednn_linear(x.reshape(rows, x.shape[-1]).contiguous(), weight, bias)
        return out.reshape(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


class DenseLinear(nn.Module):
    """y = x @ W.T + b on an fp32 CPU weight by dense_linear (oneDNN's GEMM): what an nn.Linear becomes
    where oneDNN's GEMM probed the fastest (fp32_gemm; MKL's pack, PackedLinear, is then not made)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # the same Parameter: ties (embedding / lm_head) survive
        self.register_parameter("bias", linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense_linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class PanelLinear(nn.Module):
    """y = x @ W.T + b on an fp32 CPU weight also held as panels of 16 outputs (csrc/f32_linear_cpu.cpp): what an
    nn.Linear becomes where that GEMM probed the fastest (fp32_gemm). Batches of LARGE_ROWS rows or more take it
    too where it is also the fastest there (large_batch_gemm), else dense_linear on the fp32 weight."""

    def __init__(self, linear: nn.Linear, kernels) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # the same Parameter: ties (embedding / lm_head) survive
        self.register_parameter("bias", linear.bias)
        self.kernels = kernels
        # A copy beside the weight (which the tied embedding and a compiled forward read), not in the state dict.
        self.register_buffer("panels", kernels.f32_pack(self.weight.detach()), persistent=False)

    def pack_bytes(self) -> int:
        return self.panels.numel() * self.panels.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # inductor lowers F.linear itself
            return F.linear(x, self.weight, self.bias)
        if x.numel() >= LARGE_ROWS * self.in_features and large_batch_gemm() != "panel":
            return dense_linear(x, self.weight, self.bias)
        flat = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, self.in_features).contiguous()
        out = self.kernels.f32_linear(flat, self.panels, self.out_features, self.bias)
        return out if flat is x else out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, " \
               "panels of 16 outputs"


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
        if rows > self.max_rows:
            return dense_linear(x, self.weight, self.bias)  # F.linear, or oneDNN's where it probed faster
        if rows < MIN_PACKED_ROWS:
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
