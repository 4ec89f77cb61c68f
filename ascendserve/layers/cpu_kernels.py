"""C++ kernels for CPUs, compiled on first use with torch's extension builder and cached.

Only what plain torch cannot do without extra memory traffic lives here: paged decode attention
(csrc/paged_decode_cpu.cpp), an fp32 GEMM on weights packed at load (csrc/f32_linear_cpu.cpp), the linears
that keep bf16, 4-bit or 8-bit weights and compute in fp32
(csrc/bf16_linear_cpu.cpp, csrc/q4_linear_cpu.cpp, csrc/q8_linear_cpu.cpp; the 4-bit one also with int8
activations, `--activation-quantization int8`), the Gated DeltaNet decode
step and prefill, each in one op (csrc/gdn_decode_cpu.cpp, csrc/gdn_prefill_cpu.cpp), the gated MLP's
silu(gate) * up in one pass (csrc/silu_and_mul_cpu.cpp), RMSNorm in one pass per row
(csrc/rms_norm_cpu.cpp), the rotary embedding in one pass (csrc/rope_cpu.cpp), and greedy sampling's
argmax (csrc/argmax_cpu.cpp).
The build needs a C++ compiler (g++) and ninja; it is cached under TORCH_EXTENSIONS_DIR (default
~/.cache/torch_extensions), so only the first process pays for it (about 30 s; a lock a killed build
left behind is removed once it is older than STALE_LOCK_SECONDS). Without a compiler,
or with ASCENDSERVE_CPU_KERNELS=0, `ops()` returns None and the layers keep their plain-torch path
(attention gathers K/V; bf16 / 4-bit / 8-bit-valued weights stay fp32; Gated DeltaNet, the gated MLP
activation, RMSNorm and rotary run as several torch ops; greedy rows use torch.argmax), after one warning
line that says why.
"""

import glob
import hashlib
import os
import sys
import threading
import time

import torch

from ascendserve.config import env_switch
from ascendserve.logger import init_logger

logger = init_logger(__name__)

_SOURCES = ["paged_decode_cpu.cpp", "f32_linear_cpu.cpp", "bf16_linear_cpu.cpp", "q4_linear_cpu.cpp",
            "q8_linear_cpu.cpp", "gdn_decode_cpu.cpp", "gdn_prefill_cpu.cpp", "silu_and_mul_cpu.cpp",
            "rms_norm_cpu.cpp", "rope_cpu.cpp", "argmax_cpu.cpp", "prefill_attention_cpu.cpp", "llama_decode_cpu.cpp"]
STALE_LOCK_SECONDS = 900  # a build takes ~30 s to ~3 min; a lock older than this is left by a killed build
_lock = threading.Lock()
_state: dict = {}  # "ops": the loaded op namespace or None once a load was tried


def ops():
    """torch.ops.ascendserve_cpu once built and loaded; None when disabled or the build failed."""
    if "ops" in _state:
        return _state["ops"]
    with _lock:
        if "ops" not in _state:
            _state["ops"] = _load()
    return _state["ops"]


def fp32_ops(*tensors: torch.Tensor):
    """ops() when every tensor is fp32 on the CPU and no forward is being compiled (the precondition the
    layers' fp32 ops share; each caller adds its own shape checks), else None. A compiled forward keeps
    the torch form, which inductor fuses."""
    if all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors) and not torch.compiler.is_compiling():
        return ops()
    return None


def float_ops(x: torch.Tensor, *tensors: torch.Tensor):
    """ops() for the elementwise ops that take fp32 or bf16 (RMSNorm, SiLU-and-mul, rotary: fp32 arithmetic, bf16
    rounded once): x fp32 or bf16 on the CPU, each other tensor fp32 or x's dtype, no forward being compiled; else
    None."""
    if (x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)
            and all(t.device.type == "cpu" and t.dtype in (torch.float32, x.dtype) for t in tensors)
            and not torch.compiler.is_compiling()):
        return ops()
    return None


def _load():
    if env_switch("ASCENDSERVE_CPU_KERNELS") is False:
        logger.info("ASCENDSERVE_CPU_KERNELS is off: plain-torch paged decode attention and fp32 weights on CPU")
        return None
    from torch.utils import cpp_extension
    # ninja from the venv (the `ninja` wheel) when the venv's bin is not on PATH.
    bin_dir = os.path.dirname(sys.executable)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    here = os.path.join(os.path.dirname(__file__), "csrc")
    start = time.perf_counter()
    name = f"ascendserve_cpu_kernels_{_build_tag(here)}"
    try:
        clear_stale_build_lock(cpp_extension._get_build_directory(name, verbose=False))
    except AttributeError:  # a torch without the helper: its builder waits on a lock as before
        pass
    try:
        cpp_extension.load(name=name,
                           sources=[os.path.join(here, s) for s in _SOURCES],
                           extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
                           extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    except Exception as e:  # no compiler, no ninja, headers missing: keep the torch path
        logger.warning("CPU kernels not built (%s: %s); paged decode attention, bf16 / 4-bit / 8-bit-valued "
                       "weights and Gated DeltaNet stay on the slower plain-torch paths. Install g++ "
                       "and ninja, or set ASCENDSERVE_CPU_KERNELS=0 to silence this.",
                       type(e).__name__, str(e).strip().splitlines()[-1] if str(e).strip() else "")
        return None
    logger.info("CPU kernels (paged decode and prefill attention, fp32 GEMM, bf16, 4-bit and 8-bit weight linears, "
                "Gated DeltaNet, SiLU-and-mul, RMSNorm, rotary, argmax, Llama decode layers) ready in %.1f s",
                time.perf_counter() - start)
    return torch.ops.ascendserve_cpu


def clear_stale_build_lock(build_dir: str, max_age_s: float = STALE_LOCK_SECONDS) -> bool:
    """Remove torch's build lock in build_dir when it is older than any build takes; whether it did.

    A process killed while it builds the kernels (e.g. a server stopped during its first start) leaves
    the lock file behind, and torch's builder then waits on it forever in every later process, silently.
    """
    lock = os.path.join(build_dir, "lock")
    try:
        age = time.time() - os.path.getmtime(lock)
    except OSError:
        return False
    if age <= max_age_s:  # another process may be building right now: say what the wait is on
        logger.info("Waiting for the CPU-kernel build another process started %.0f s ago (lock %s); if no build is "
                    "running, that process was killed: remove the lock, or it is cleared once %.0f min old",
                    age, lock, max_age_s / 60)
        return False
    logger.warning("Removing a stale CPU-kernel build lock (%s, %.0f min old): an earlier build was interrupted",
                   lock, age / 60)
    try:
        os.remove(lock)
    except OSError:
        return False
    return True


def _build_tag(csrc: str) -> str:
    """A short hash of the CPU's feature flags and of the shared headers: a build with -march=native is
    reused only on a CPU like it, and a changed header means a new build (torch's builder hashes the
    sources it is given, not what they include)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    digest = hashlib.sha256(flags.encode())
    for header in sorted(glob.glob(os.path.join(csrc, "*.h"))):
        with open(header, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:8]
