"""tcmalloc for the engine's process on CPU: the command line restarts itself with it preloaded.

Why: glibc's malloc hands every block above its mmap threshold (at most 32 MiB) back to the kernel on
free, so each prefill step's activations come back as fresh pages that the kernel faults in and zeroes
again. tcmalloc keeps freed spans for reuse. One 8 x 256 prefill step of the Qwen3.5-0.8B shape:
6.3-6.5 M -> 1.86 M minor page faults for a 3-step process, 13.2-16.5 -> 8.6-11.3 s a step
(BENCHMARKS.md). Tuning glibc instead (one arena, 1 GiB mmap / trim thresholds) was tried and
dropped: torch allocates with posix_memalign(64), whose padding kept freed blocks from being reused.

A malloc can only be swapped at process start (LD_PRELOAD), so `ascendserve serve|generate|bench
throughput|bench latency` on CPU exec themselves again, same pid and arguments, with the library
preloaded, when it is installed (Debian / Ubuntu: libtcmalloc-minimal4) and not already loaded. The
offline `LLM` class runs in the caller's process, where nothing is swapped: preload it yourself
(`LD_PRELOAD=libtcmalloc_minimal.so.4 python ...`), as vLLM's CPU guide also asks.

ASCENDSERVE_CPU_ALLOCATOR: "auto" (default: tcmalloc when found), "system" (glibc's malloc), or the
path of a malloc library to preload instead (jemalloc, say).
"""

import ctypes.util
import os
import sys

from ascendserve.cli.config_file import CONFIG_FLAG, read_config_file

ENV_VAR = "ASCENDSERVE_CPU_ALLOCATOR"
_EXECED = "ASCENDSERVE_CPU_ALLOCATOR_EXECED"  # set in the restarted process: never restart twice
_ENGINE_COMMANDS = {("serve",), ("generate",), ("bench", "throughput"), ("bench", "latency")}
# Device nodes of the accelerators the auto device would pick before the CPU.
_ACCELERATOR_NODES = ("/dev/nvidiactl", "/dev/davinci_manager")
_KNOWN_MALLOCS = ("tcmalloc", "jemalloc", "mimalloc")


def _runs_engine(argv: list[str]) -> bool:
    words = [a for a in argv if not a.startswith("-")][:2]
    return tuple(words[:1]) in _ENGINE_COMMANDS or tuple(words) in _ENGINE_COMMANDS


def _flag(argv: list[str], name: str) -> str | None:
    """The value of `name` on the command line (`--name V` or `--name=V`), else None."""
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def _device(argv: list[str]) -> str:
    """--device as the command line gives it, else as its `--config` file does (`device: cpu`), else auto. A file
    that does not read is left to the parser to report."""
    device = _flag(argv, "--device")
    if device is not None:
        return device
    path = _flag(argv, CONFIG_FLAG)
    if path is not None:
        import yaml
        try:
            data = read_config_file(path)
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            data = None
        if isinstance(data, dict) and isinstance(data.get("device"), str):
            return data["device"]
    return "auto"


def _on_cpu(argv: list[str]) -> bool:
    device = _device(argv)
    if device == "auto":
        return not any(os.path.exists(node) for node in _ACCELERATOR_NODES)
    return device.split(":")[0] == "cpu"


def loaded_malloc() -> str | None:
    """The name of the replacement malloc mapped into this process ("tcmalloc", ...), else None."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            maps = f.read()
    except OSError:
        return None
    return next((name for name in _KNOWN_MALLOCS if name in maps), None)


def find_tcmalloc() -> str | None:
    """The installed tcmalloc's library name (libtcmalloc_minimal.so.4, ...), else None."""
    return ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")


def preload_env(argv: list[str], env: dict[str, str]) -> dict[str, str] | None:
    """The environment to restart `argv` with (LD_PRELOAD set), or None when it should run as it is."""
    choice = env.get(ENV_VAR, "auto")
    if choice == "system" or env.get(_EXECED) or not sys.platform.startswith("linux"):
        return None
    if not _runs_engine(argv) or not _on_cpu(argv) or loaded_malloc():
        return None
    library = find_tcmalloc() if choice == "auto" else choice
    if not library:
        return None
    preload = env.get("LD_PRELOAD")
    new = {**env, _EXECED: "1", "LD_PRELOAD": f"{library}:{preload}" if preload else library}
    # tcmalloc prints a line for every allocation above 1 GiB (a big checkpoint tensor); not an error.
    new.setdefault("TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD", str(1 << 40))
    return new


def restart_with_preloaded_malloc(argv: list[str]) -> None:
    """Exec this process's command line (the ascendserve words `argv`) again under tcmalloc where `preload_env`
    says so; returns otherwise."""
    env = preload_env(argv, dict(os.environ))
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def describe(argv: list[str]) -> str | None:
    """One log line on the malloc this engine process uses (None where no engine runs on CPU)."""
    if not _runs_engine(argv) or not _on_cpu(argv):
        return None
    name = loaded_malloc()
    if name:
        return f"CPU allocator: {name} ({ENV_VAR}=system for glibc's malloc)"
    choice = os.environ.get(ENV_VAR, "auto")
    if choice == "system":
        return f"CPU allocator: glibc malloc ({ENV_VAR}=system)"
    if choice != "auto":
        return f"CPU allocator: glibc malloc ({ENV_VAR}={choice} could not be preloaded: see the ld.so line above)"
    return ("CPU allocator: glibc malloc; install tcmalloc (Debian / Ubuntu: apt install libtcmalloc-minimal4) "
            "for fewer page faults and faster prefill")
