"""CPU: the reference path every other platform is compared with."""

import ctypes
import os
import platform as host_platform

import torch

from ascendserve.config import env_switch
from ascendserve.logger import init_logger
from ascendserve.platforms.interface import Platform

logger = init_logger(__name__)

# Default KV pool on CPU: a quarter of the memory available now, at most 4 GiB (vLLM's CPU backend
# also defaults to a fixed few GiB, not a share of all RAM, since RAM is shared with everything else).
CPU_KV_CACHE_FRACTION = 0.25
CPU_KV_CACHE_MAX_BYTES = 4 << 30


# glibc's malloc on the model thread. By default every allocation above 32 MiB (and, on a thread's own
# arena, above its 64 MiB heaps) is a fresh mmap, returned to the kernel when freed: a prefill step's
# activations (2048 tokens x 8192 fp32 = 64 MiB for one projection) are page-faulted in anew on every
# layer of every step, at ~3 GB/s. With one arena (the main one, grown by brk) and blocks up to 1 GiB
# taken from it and kept after free, the next step reuses the pages. Measured on the Qwen3.5-0.8B
# shape, one 8 x 256-token prefill step (2 threads, three steps, two processes each): 13.2-16.2 s ->
# 10.4-12.1 s; decode steps unchanged. Memory: freed blocks stay resident up to the step's peak.
MALLOC_KEEP_BYTES = 1 << 30
MALLOC_ENV_VAR = "ASCENDSERVE_CPU_MALLOC"  # 0: leave glibc's malloc settings alone
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8  # glibc's <malloc.h>
_USER_MALLOC_ENV = ("MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")
_malloc_state: dict = {}


def keep_freed_memory() -> bool:
    """Set glibc malloc to one arena that keeps freed blocks up to MALLOC_KEEP_BYTES; once per process.

    True when applied (now or before). Not applied, with one log line saying why: ASCENDSERVE_CPU_MALLOC=0,
    the user's own MALLOC_* / GLIBC_TUNABLES settings (they win), or a C library other than glibc.
    Must run before the model thread's first allocation: a thread keeps the arena it started on.
    """
    if "applied" in _malloc_state:
        return _malloc_state["applied"]
    reason = None
    if env_switch(MALLOC_ENV_VAR) is False:
        reason = f"{MALLOC_ENV_VAR}=0"
    elif user := [name for name in _USER_MALLOC_ENV if name in os.environ]:
        reason = f"{user[0]} is set"
    elif host_platform.libc_ver()[0] != "glibc":
        reason = "the C library is not glibc"
    else:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
        settings = ((_M_ARENA_MAX, 1), (_M_MMAP_THRESHOLD, MALLOC_KEEP_BYTES), (_M_TRIM_THRESHOLD, MALLOC_KEEP_BYTES))
        if not all(mallopt(option, value) for option, value in settings):
            reason = "glibc refused the settings"
    _malloc_state["applied"] = reason is None
    if reason is None:
        logger.info("CPU: malloc keeps freed blocks of up to %d MiB for reuse (one arena), so large activations "
                    "are not page-faulted in again every step; %s=0 turns this off", MALLOC_KEEP_BYTES >> 20,
                    MALLOC_ENV_VAR)
    else:
        logger.info("CPU: malloc settings left as they are (%s)", reason)
    return _malloc_state["applied"]


def cpu_has_fast_bf16() -> bool:
    """True when the CPU multiplies bf16 natively (AMX or AVX512-BF16); else bf16 is emulated and slow."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


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
        # against ~240 for fp32, so half-precision checkpoints run in fp32 there. With AMX, bf16
        # wins from about 8 rows on (shared/reference/cpu_peers.md §6); fp16 is slow on every CPU.
        if checkpoint_dtype in (torch.float16, torch.bfloat16):
            if cpu_has_fast_bf16():
                return torch.bfloat16
            logger.info("this CPU has no native bf16 (no AMX / AVX512-BF16): computing in float32 (bf16 "
                        "linear weights stay bf16 where the CPU kernels build, layers/linear.py); pass --dtype "
                        "bfloat16 to override")
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

    def configure_process(self) -> None:
        keep_freed_memory()

    def default_kv_cache_bytes(self, gpu_memory_utilization: float, weight_bytes: int) -> int:
        free, _ = self.mem_get_info()
        return int(min(free * CPU_KV_CACHE_FRACTION, CPU_KV_CACHE_MAX_BYTES))
