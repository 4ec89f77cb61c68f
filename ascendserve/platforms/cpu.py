"""CPU: the reference path every other platform is compared with."""

import ctypes
import os
import sys

import torch

from ascendserve.logger import init_logger
from ascendserve.platforms.interface import Platform

logger = init_logger(__name__)

# Default KV pool on CPU: a quarter of the memory available now, at most 4 GiB (vLLM's CPU backend
# also defaults to a fixed few GiB, not a share of all RAM, since RAM is shared with everything else).
CPU_KV_CACHE_FRACTION = 0.25
CPU_KV_CACHE_MAX_BYTES = 4 << 30
# vLLM's CPU backend reads the KV cache size in GiB from this variable (0 or unset: its default).
KV_CACHE_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"


# vLLM's CPU backend binds its OpenMP threads to the cores this variable lists ("0-31", "0-3,8"; one group per
# tensor-parallel rank, split by "|"); "auto" (its default: a NUMA node's cores) and "nobind" leave torch's default.
THREADS_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def omp_threads_bind() -> list[int] | None:
    """The cores VLLM_CPU_OMP_THREADS_BIND names (None: unset, auto or nobind); ValueError for a list that does not
    parse or names a core this process may not run on."""
    value = os.environ.get(THREADS_BIND_ENV, "").strip()
    if value in ("", "auto", "nobind"):
        return None
    group = value.split("|")[0]  # one rank runs the model: the first group
    cpus: set[int] = set()
    try:
        for item in group.split(","):
            first, dash, last = item.strip().partition("-")
            cpus.update(range(int(first), int(last if dash else first) + 1))
    except ValueError:
        cpus = set()
    if not cpus:
        raise ValueError(f"{THREADS_BIND_ENV} must list cores such as 0-31 or 0-3,8 (or be auto / nobind), got "
                         f"{value!r}")
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else cpus
    if not cpus <= allowed:
        raise ValueError(f"{THREADS_BIND_ENV}={value!r} names cores {sorted(cpus - allowed)} this process may not run "
                         f"on (it may run on {_ranges(sorted(allowed))})")
    return sorted(cpus)


def bind_model_thread() -> list[int] | None:
    """On the model thread, before its first torch op: pin it (and so the OpenMP threads it starts) to the cores
    VLLM_CPU_OMP_THREADS_BIND names, one OpenMP thread per core, as vLLM's CPU worker does; the API server's threads
    stay unpinned. Returns the cores, None when nothing is bound."""
    cpus = omp_threads_bind()
    if cpus is None:
        return None
    os.sched_setaffinity(0, cpus)  # 0: the calling thread
    torch.set_num_threads(len(cpus))
    logger.info("Model thread bound to cores %s (%s), %d OpenMP threads", _ranges(cpus), THREADS_BIND_ENV, len(cpus))
    return cpus


def _ranges(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    out, start = [], None
    for i, cpu in enumerate(cpus):
        start = cpu if start is None else start
        if i + 1 == len(cpus) or cpus[i + 1] != cpu + 1:
            out.append(f"{start}-{cpu}" if cpu != start else str(cpu))
            start = None
    return ",".join(out)


def kv_cache_space_bytes() -> int | None:
    """VLLM_CPU_KVCACHE_SPACE in bytes (GiB as vLLM reads it; None when unset or 0); ValueError for a value that is
    not a number of GiB at or above 0."""
    value = os.environ.get(KV_CACHE_SPACE_ENV, "").strip()
    if not value:
        return None
    try:
        gib = float(value)
    except ValueError:
        gib = -1.0
    if not gib >= 0:
        raise ValueError(f"{KV_CACHE_SPACE_ENV} must be the KV cache size in GiB (e.g. 40; 0 or unset: the default, "
                         f"a quarter of the available memory, at most 4 GiB), got {value!r}")
    return int(gib * (1 << 30)) or None


HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # linux/mman.h


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """madvise(MADV_HUGEPAGE) over the whole 2 MiB pages inside a CPU tensor's memory, so that (with THP
    in "madvise" or "always" mode) they are faulted in as huge pages when first touched. Best effort:
    False where it does not apply (not Linux, no whole 2 MiB page inside, a kernel without THP)."""
    if not sys.platform.startswith("linux"):
        return False
    start = tensor.data_ptr()
    lo = -(-start // HUGE_PAGE) * HUGE_PAGE
    hi = (start + tensor.untyped_storage().nbytes()) // HUGE_PAGE * HUGE_PAGE
    if hi <= lo:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        return False


def _cpuinfo(*keys: str) -> dict[str, str]:
    """The first value /proc/cpuinfo gives for each of `keys` (the first CPU's; missing where it cannot be read)."""
    found: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in keys and key not in found:
                    found[key] = value.strip()
                    if len(found) == len(keys):
                        break
    except OSError:
        pass
    return found


def cpu_flags() -> set[str]:
    """The `flags` line of /proc/cpuinfo (empty where it cannot be read)."""
    return set(_cpuinfo("flags").get("flags", "").split())


def cpu_has_fast_bf16() -> bool:
    """True when the CPU multiplies bf16 natively (AMX or AVX512-BF16); else bf16 is emulated and slow."""
    flags = cpu_flags()
    return "amx_bf16" in flags or "avx512_bf16" in flags


def cpu_vendor() -> str:
    """The vendor_id of /proc/cpuinfo ("AuthenticAMD", "GenuineIntel"; "" where unknown)."""
    return _cpuinfo("vendor_id").get("vendor_id", "")


def bf16_by_default() -> bool:
    """Whether `--dtype auto` runs a bf16 / fp16 checkpoint in bf16 here: with AMX, or with AVX512-BF16 on an AMD CPU
    (Zen 4 and later); elsewhere (Intel Cooper Lake: AVX512-BF16 without AMX, not measured) in fp32 from bf16 weights.

    Served, against vLLM's CPU build (BENCHMARKS.md run 101, 2-core Zen 4, random 256 in / 128 out, output tok/s at
    8 / 16 / 64 streams): the demo fp32 162 / 179 / 196, bf16 265 / 307 / 363 (vLLM bf16 200 / 254 / 328); the
    Qwen3.5-0.8B shape fp32 49 / 50 / 50, bf16 80 / 88 / 94. In-process there (benchmarks/probe_dtype_steps.py, ms per
    step at 1 / 8 / 64 streams, s per 8 x 256 prefill): the demo fp32 9.9 / 25.6 / 135.7, 2.6-3.1 s, bf16 13.6 / 16.4 /
    65.9, 1.3 s; Qwen3.5 fp32 54.6 / 80.2 / 588.0, 11.6-11.8 s, bf16 55.6 / 53.7 / 339.9, 6.0 s (one stream of the demo
    stays faster in fp32, which reads its 4-bit copies: `--dtype float32`). Session 18's in-process figures below,
    taken before the bf16 norm / activation / rotary / Gated DeltaNet ops existed, had fp32 ahead on Zen 4.

    In-process (benchmarks/probe_dtype_steps.py), median ms per decode step at 1 / 8 / 64 streams and s per 8 x 256
    prefill, fp32 against bf16:
    - 2-core AMD EPYC Zen 5 (family 26, session 20, with the bf16 norm / activation / rotary / Gated DeltaNet ops):
      Qwen3.5-0.8B shape fp32 38 / 64 / 399 ms, 7.6-8.9 s; bf16 38 / 59 / 258 ms, 4.3-4.6 s. The demo (SmolLM2,
      Q4_1) fp32 12 / 21 / 92 ms, 1.7-1.9 s; bf16 17 / 18 / 61 ms, 0.95 s (at one stream its fp32 layers read 4-bit
      copies).
    - 2-core AMD EPYC Zen 4 (session 18, before those bf16 ops): Qwen3.5 shape fp32 53 / 102 / 746 ms, 13.3 s; bf16
      122 / 189 / 851 ms, 15.1 s. The demo fp32 13 / 34 / 222 ms, 3.0 s; bf16 25 / 33 / 132 ms, 2.2 s.
    - 2-core Xeon with AMX (session 19): bf16 3.7-4.3x fp32 in prefill, 2.4-2.7x at 64 streams."""
    flags = cpu_flags()
    if "amx_bf16" in flags:
        return True
    return "avx512_bf16" in flags and cpu_vendor() == "AuthenticAMD"


class CpuPlatform(Platform):
    """Plain torch on the host."""

    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    # Not yet shown to help here: an interleaved A/B of the demo's decode step (compiled norms,
    # activations, rotary vs eager) was inconclusive on a loaded 2-core host, and compiling costs
    # 10-50 s at start-up. ASCENDSERVE_COMPILE=1 turns it on.
    compile_by_default = False

    def is_available(self) -> bool:
        return True

    def device(self, index: int = 0) -> torch.device:
        return torch.device("cpu")

    def default_dtype(self, checkpoint_dtype: torch.dtype | None) -> torch.dtype:
        # Measured on a 2-core AVX-512 Xeon without AMX/AVX512-BF16: bf16 GEMMs ran at ~65 GFLOP/s
        # against ~240 for fp32, so half-precision checkpoints run in fp32 there. With AMX, and with AVX512-BF16
        # on AMD Zen 4 / Zen 5, bf16 wins (shared/reference/cpu_peers.md §6, bf16_by_default); fp16 is slow on
        # every CPU.
        if checkpoint_dtype in (torch.float16, torch.bfloat16):
            if bf16_by_default():
                return torch.bfloat16
            native = "AVX512-BF16 without AMX" if cpu_has_fast_bf16() else "no native bf16 (no AMX / AVX512-BF16)"
            logger.info("this CPU has %s: computing in float32 (bf16 linear weights stay bf16 where the CPU kernels "
                        "build, layers/compact_linear.py); pass --dtype bfloat16 to override", native)
            return torch.float32
        return checkpoint_dtype or torch.float32

    def check_dtype(self, dtype: torch.dtype) -> torch.dtype:
        if dtype == torch.float16:
            logger.warning("float16 is slow on CPU; using bfloat16 instead")
            return torch.bfloat16
        return super().check_dtype(dtype)

    def mem_get_info(self) -> tuple[int, int]:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        try:
            with open("/proc/meminfo") as f:
                info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
            return info.get("MemAvailable", pages), info.get("MemTotal", pages)
        except OSError:
            return pages, pages

    def default_kv_cache_bytes(self, gpu_memory_utilization: float, weight_bytes: int) -> int:
        free, _ = self.mem_get_info()
        return int(min(free * CPU_KV_CACHE_FRACTION, CPU_KV_CACHE_MAX_BYTES))
