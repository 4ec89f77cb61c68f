"""The CUDA path on one GPU: the device's ceilings, then ascendserve in-process and served, against transformers'
`generate` on the same GPU and against the single-stream roofline (weight bytes per decode step over the measured
bandwidth). Issue #5's workloads: random 256-token prompts, 128 output tokens (ignore_eos, greedy), C streams at once.

Models (random weights in bf16, so nothing is downloaded): the demo's shape (SmolLM2-135M: its config and tokenizer
from --demo-dir) and Qwen3.5-0.8B's shape (benchmarks/qwen3_5_speed.py) with the Qwen3.5 tokenizer fixture
(--qwen-tokenizer). benchmarks/cuda_run.sh runs this on the lent GPU machine:

    python benchmarks/cuda_bench.py --work /tmp/cuda-bench --demo-dir .gpu/demo \
        --qwen-tokenizer .gpu/qwen3_5_tokenizer --out $OUT [--models qwen35,demo] [--concurrency 1,8,16,64,256] \
        [--stages graphs-triton,graphs,served-graphs-triton,served-graphs,compiled,hf,served,eager]

`--device cpu` with `--tiny` runs the same code on small shapes (a check of the script, not a measurement).
In-process figures: output tok/s = C x 128 / the time of the whole batch; decode tok/s = C x 127 / (that time less
the time of the same batch with max_tokens=1, i.e. without its prefill and first token).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from ascendserve.layers import triton_kernels  # noqa: E402

PROMPT_LEN, OUTPUT_LEN = 256, 128
# in the order they run, the newest first; "-triton": with ASCENDSERVE_TRITON_KERNELS=1 (layers/triton_ops.py)
STAGES = ("graphs-triton", "graphs", "prefill-lengths", "served-graphs-triton", "served-graphs", "compiled", "hf",
          "served", "eager")
TRITON_ENV = triton_kernels.ENV_VAR
CHUNKED_ENV = triton_kernels.CHUNKED_PREFILL_ENV
PREFILL_MODES = ("torch", "triton", "triton-chunked")  # prefill-lengths: kernels off, on, on with the chunked prefill
GRAPHS = {"cudagraph_mode": "FULL_DECODE_ONLY"}
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=16)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", required=True, help="where the random checkpoints are written")
    p.add_argument("--out", required=True, help="where results.json and the logs go")
    p.add_argument("--demo-dir", required=True, help="the demo's config.json and tokenizer files")
    p.add_argument("--qwen-tokenizer", required=True, help="a Qwen3.5 tokenizer directory (tests/fixtures)")
    p.add_argument("--models", default="qwen35,demo")
    p.add_argument("--concurrency", default="1,8,16,64,256")
    p.add_argument("--stages", default=",".join(STAGES),
                   help=f"any of {', '.join(STAGES)} (graphs: compilation_config cudagraph_mode FULL_DECODE_ONLY; "
                        f"served-graphs: the server with it; -triton: the Triton kernels on; prefill-lengths: one "
                        f"prompt of 256 / 1024 / 4096 tokens, Triton kernels off, on, on with the chunked prefill)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="small shapes: checks the script, measures nothing")
    return p.parse_args(argv)


# -- the device ------------------------------------------------------------------------------------------------------
def ceilings(device: str) -> dict:
    """Device-to-device copy bandwidth (bytes read + written, 2 GiB buffers) and the bf16 matrix rate (8192^3),
    each the median of 10 timed runs after 3 warm-ups."""
    if device != "cuda":
        return {}
    n = 1 << 30  # bf16 elements: 2 GiB
    src, dst = torch.randn(n, device="cuda", dtype=torch.bfloat16), torch.empty(n, device="cuda", dtype=torch.bfloat16)
    copy_ms = _median_ms(lambda: dst.copy_(src))
    del src, dst
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    mm_ms = _median_ms(lambda: a @ b)
    del a, b
    torch.cuda.empty_cache()
    props = torch.cuda.get_device_properties(0)
    return {"gpu": props.name, "sms": props.multi_processor_count, "memory_gib": props.total_memory / 2**30,
            "copy_gb_s": 2 * 2 * n / copy_ms / 1e6, "bf16_tflop_s": 2 * 8192**3 / mm_ms / 1e9,
            "torch": torch.__version__, "cuda": torch.version.cuda}


def _median_ms(fn, reps: int = 10) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


# -- the models ------------------------------------------------------------------------------------------------------
def build_models(ns) -> dict[str, Path]:
    """name -> a random bf16 checkpoint directory with its tokenizer."""
    from transformers import AutoModelForCausalLM, LlamaConfig
    from transformers.models.qwen3_5 import Qwen3_5TextConfig

    from qwen3_5_speed import QWEN3_5_08B
    work, out = Path(ns.work), {}
    for name in ns.models.split(","):
        path = work / name
        if name == "demo":
            cfg = json.loads((Path(ns.demo_dir) / "config.json").read_text())
            cfg = {k: v for k, v in cfg.items() if k not in ("dtype", "torch_dtype", "transformers_version")}
            if ns.tiny:
                cfg.update({k: TINY[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                 "num_attention_heads", "num_key_value_heads")})
            config, tokenizer = LlamaConfig(**cfg), Path(ns.demo_dir)
            config.architectures = ["LlamaForCausalLM"]
        elif name == "qwen35":
            config = Qwen3_5TextConfig(**{**QWEN3_5_08B, **(TINY if ns.tiny else {})},
                                       architectures=["Qwen3_5ForCausalLM"])
            tokenizer = Path(ns.qwen_tokenizer)
        else:
            raise SystemExit(f"--models: unknown model {name!r} (demo, qwen35)")
        if not (path / "config.json").exists():
            torch.manual_seed(0)
            with torch.device(ns.device):  # random init on the GPU: seconds instead of a minute on the CPU
                model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
            model.save_pretrained(path)
            del model
            for f in tokenizer.iterdir():
                if f.is_file() and not f.name.startswith(".") and f.name != "config.json" and not f.suffix == ".gguf":
                    shutil.copy(f, path / f.name)
        out[name] = path
    return out


def decode_weight_bytes(path: Path) -> int:
    """Bytes of weights one decode step reads from a bf16 checkpoint (compare_models.hf_decode_params: all but the
    embedding table, a tied lm_head once)."""
    from compare_models import hf_decode_params
    return 2 * hf_decode_params(path)


def prompts(count: int, vocab: int, seed: int, length: int = PROMPT_LEN) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, min(vocab, 200000) - 1, (count, length), generator=g).tolist()


# -- ascendserve in-process ------------------------------------------------------------------------------------------
def with_triton(run, *args, **kwargs) -> dict:
    """run(*args, **kwargs) with the Triton kernels on (the switch is read as each step runs)."""
    os.environ[TRITON_ENV] = "1"
    try:
        return run(*args, **kwargs)
    finally:
        os.environ.pop(TRITON_ENV, None)


def inprocess(path: Path, levels: list[int], device: str, eager: bool, vocab: int, graphs: bool = False) -> dict:
    from ascendserve import LLM, SamplingParams
    start = time.perf_counter()
    llm = LLM(str(path), skip_tokenizer_init=True, dtype="bfloat16", device=device, enforce_eager=eager,
              compilation_config=GRAPHS if graphs else None,
              max_model_len=PROMPT_LEN + OUTPUT_LEN + 16, kv_cache_memory_bytes=8 << 30, max_num_seqs=max(levels),
              max_num_batched_tokens=8192)
    load_s = time.perf_counter() - start

    def timed(batch, max_tokens) -> float:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        _sync(device)
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        _sync(device)
        assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)
        return time.perf_counter() - t0

    start = time.perf_counter()
    for c in sorted(set(levels)):  # warm-up: every batch size's graphs compiled before anything is timed
        timed(prompts(c, vocab, 99), 4)
    result = {"load_s": load_s, "warmup_s": time.perf_counter() - start, "levels": {}}
    for c in levels:
        batch = prompts(c, vocab, c)
        first, whole = timed(batch, 1), timed(batch, OUTPUT_LEN)
        result["levels"][c] = {"output_tok_s": c * OUTPUT_LEN / whole,
                               "decode_tok_s": c * (OUTPUT_LEN - 1) / (whole - first), "prefill_s": first,
                               "total_s": whole}
        mode = ("graphs" if graphs else "eager" if eager else "compiled") + ("-triton" if os.environ.get(TRITON_ENV)
                                                                            else "")
        print(f"  ascendserve {mode} C={c}: "
              f"{result['levels'][c]}", flush=True)
    del llm
    _free(device)
    return result


def prefill_lengths(path: Path, device: str, vocab: int, lengths=(256, 1024, 4096), reps: int = 3) -> dict:
    """One prompt's prefill (max_tokens=1, compiled, eager steps) at each length, the Triton kernels off, on, and on
    with the chunked prefill in turn on one engine (the switches are read as each step runs): the Triton prefill's
    delta rule runs token by token unless ASCENDSERVE_TRITON_CHUNKED_PREFILL=1, the torch form chunked, so long
    prompts are where they may part. Median ms of `reps` after a warm-up."""
    from ascendserve import LLM, SamplingParams
    llm = LLM(str(path), skip_tokenizer_init=True, dtype="bfloat16", device=device, max_model_len=max(lengths) + 16,
              kv_cache_memory_bytes=8 << 30, max_num_seqs=4, max_num_batched_tokens=max(lengths))
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    result = {}
    try:
        for n in lengths:
            prompt = [{"prompt_token_ids": prompts(1, vocab, n, n)[0]}]
            for mode in PREFILL_MODES:
                os.environ[TRITON_ENV] = "0" if mode == "torch" else "1"
                os.environ[CHUNKED_ENV] = "1" if mode == "triton-chunked" else "0"
                times = []
                for _ in range(reps + 1):
                    _sync(device)
                    t0 = time.perf_counter()
                    llm.generate(prompt, params, use_tqdm=False)
                    _sync(device)
                    times.append(1e3 * (time.perf_counter() - t0))
                result[f"{mode}-{n}"] = sorted(times[1:])[len(times[1:]) // 2]
            print(f"  prefill {n} tokens, ms: " + ", ".join(f"{m} {result[f'{m}-{n}']:.1f}" for m in PREFILL_MODES),
                  flush=True)
    finally:  # the later stages run with the switches as the environment had them
        os.environ.pop(TRITON_ENV, None)
        os.environ.pop(CHUNKED_ENV, None)
    del llm
    _free(device)
    return result


# -- transformers generate -------------------------------------------------------------------------------------------
def hf_generate(path: Path, levels: list[int], device: str, vocab: int) -> dict:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()
    model.generation_config.eos_token_id = None

    def timed(batch, new) -> float:
        ids = torch.tensor(batch, device=device)
        _sync(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, pad_token_id=0)
        _sync(device)
        assert out.shape[1] == PROMPT_LEN + new
        return time.perf_counter() - t0

    timed(prompts(1, vocab, 99), 4)
    result = {}
    for c in levels:
        batch = prompts(c, vocab, c)
        first, whole = timed(batch, 1), timed(batch, OUTPUT_LEN)
        result[c] = {"output_tok_s": c * OUTPUT_LEN / whole, "decode_tok_s": c * (OUTPUT_LEN - 1) / (whole - first),
                     "prefill_s": first, "total_s": whole}
        print(f"  transformers C={c}: {result[c]}", flush=True)
    del model
    _free(device)
    return result


# -- served ----------------------------------------------------------------------------------------------------------
def served(path: Path, name: str, levels: list[int], device: str, work: Path, graphs: bool = False) -> dict:
    """`ascendserve serve` on the device, measured by `ascendserve bench serve` at each level (max(8, 2C) prompts).
    Result files and the server's log go under `work` (what comes back from the GPU machine is a few files); the
    log's last lines are printed when the stage ends."""
    from tests.server.utils import free_port
    port, tag = free_port(), (f"{name}-graphs" if graphs else name) + ("-triton" if os.environ.get(TRITON_ENV) else "")
    files = work / f"served-{tag}"
    files.mkdir(parents=True, exist_ok=True)
    log = open(files / "server.log", "w")
    cmd = [sys.executable, "-m", "ascendserve.cli.main", "serve", str(path), "--host", "127.0.0.1", "--port",
           str(port), "--device", device, "--dtype", "bfloat16", "--served-model-name", name, "--max-num-seqs",
           str(max(levels)), "--max-model-len", "1024", "--kv-cache-memory-bytes", str(8 << 30),
           "--max-num-batched-tokens", "8192", "--uvicorn-log-level", "warning"]
    cmd += ["--compilation-config", json.dumps(GRAPHS)] if graphs else []
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    result = {"command": " ".join(cmd[2:]), "levels": {}}
    try:
        _wait_health(proc, port)
        base = ["--base-url", f"http://127.0.0.1:{port}", "--model", name, "--dataset", "random",
                "--random-input-len", str(PROMPT_LEN), "--ignore-eos", "--disable-tqdm", "--save-result",
                "--result-dir", str(files)]
        for c in levels:  # a warm-up at each level first (compiles / captures that batch size), then the measured run
            _bench(base + ["--random-output-len", "8", "--num-prompts", str(c), "--max-concurrency", str(c),
                           "--seed", "99", "--result-filename", f"warm-c{c}.json"])
            res = _bench(base + ["--random-output-len", str(OUTPUT_LEN), "--num-prompts", str(max(8, 2 * c)),
                                 "--max-concurrency", str(c), "--seed", str(c), "--result-filename", f"c{c}.json"],
                         files / f"c{c}.json")
            result["levels"][c] = {k: res[k] for k in ("output_throughput", "median_ttft_ms", "median_tpot_ms",
                                                       "completed", "failed", "num_prompts")}
            print(f"  served {tag} C={c}: {result['levels'][c]}", flush=True)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        kept = [line for line in (files / "server.log").read_text(errors="replace").splitlines()
                if "Received request" not in line and "Avg prompt throughput" not in line]
        print("  server log, last lines:\n    " + "\n    ".join(kept[-8:]), flush=True)
    return result


def _wait_health(proc, port: int, timeout_s: float = 300) -> None:
    import httpx
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError("server not ready")


def _bench(args: list[str], result_file: Path | None = None) -> dict:
    subprocess.run([sys.executable, "-m", "ascendserve.cli.main", "bench", "serve", *args], check=True, cwd=REPO,
                   stdout=subprocess.DEVNULL)
    return json.loads(result_file.read_text()) if result_file else {}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _free(device: str) -> None:
    import gc
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


# -- the report ------------------------------------------------------------------------------------------------------
def report(results: dict) -> str:
    """A table per model: each in-process mode's output / decode tok/s, transformers', the best of ours over
    transformers', and each served mode's output tok/s / TTFT p50 / TPOT p50; then single stream against the
    roofline."""
    lines = []
    dev = results.get("device", {})
    if dev:
        lines.append(f"{dev['gpu']}, {dev['sms']} SMs, {dev['memory_gib']:.0f} GiB; torch {dev['torch']} (CUDA "
                     f"{dev['cuda']}); copy {dev['copy_gb_s']:.0f} GB/s, bf16 matmul {dev['bf16_tflop_s']:.0f} "
                     f"TFLOP/s")
    inprocess_keys = ("graphs-triton", "graphs", "compiled", "eager", "hf")
    served_keys = ("served-graphs-triton", "served-graphs", "served")
    for name, r in results["models"].items():
        bw = dev.get("copy_gb_s")
        roof = bw * 1e9 / r["decode_weight_bytes"] if bw else None
        lines.append(f"\n{name}: {r['decode_weight_bytes'] / 1e9:.2f} GB of weights per decode step"
                     + (f"; single-stream roofline {roof:.0f} tok/s" if roof else ""))
        lines.append("| C | " + " | ".join(f"{k} out / decode tok/s" for k in inprocess_keys) + " | best ours / hf | "
                     + " | ".join(f"{k} out tok/s / TTFT / TPOT ms" for k in served_keys) + " |")
        lines.append("|---" * (len(inprocess_keys) + len(served_keys) + 2) + "|")
        for c in results["levels"]:
            runs = {k: (r[k] if k == "hf" else r[k].get("levels", {})).get(c) for k in inprocess_keys
                    if isinstance(r.get(k), dict) and "error" not in r[k]}
            cells = [f"{x['output_tok_s']:.1f} / {x['decode_tok_s']:.1f}" if (x := runs.get(k)) else "-"
                     for k in inprocess_keys]
            ours = max((runs[k]["output_tok_s"] for k in inprocess_keys[:-1] if runs.get(k)), default=None)
            cells.append(f"{ours / runs['hf']['output_tok_s']:.2f}x" if ours and runs.get("hf") else "-")
            for k in served_keys:
                x = r.get(k, {}).get("levels", {}).get(c)
                cells.append(f"{x['output_throughput']:.1f} / {x['median_ttft_ms']:.0f} / {x['median_tpot_ms']:.1f}"
                             if x else "-")
            lines.append(f"| {c} | " + " | ".join(cells) + " |")
        for k in inprocess_keys[:-1]:
            one = r.get(k, {}).get("levels", {}).get(1) if isinstance(r.get(k), dict) else None
            if one and roof:
                lines.append(f"{k}: single-stream decode {one['decode_tok_s']:.1f} tok/s = "
                             f"{one['decode_tok_s'] / roof:.1%} of the roofline")
        if (lengths := r.get("prefill-lengths")) and "error" not in lengths:
            sizes = [k.removeprefix("torch-") for k in lengths if k.startswith("torch-")]
            lines.append("one prompt's prefill, ms (Triton kernels off / on / on with the chunked prefill): " +
                         ", ".join(f"{n} tokens " + " / ".join(f"{lengths[f'{m}-{n}']:.1f}" for m in PREFILL_MODES)
                                   for n in sizes))
        for k, v in r.items():
            if isinstance(v, dict) and "error" in v:
                lines.append(f"{k} failed: {v['error']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ns = parse_args(argv)
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    Path(ns.work).mkdir(parents=True, exist_ok=True)
    levels = [int(c) for c in ns.concurrency.split(",")]
    stages = set(ns.stages.split(","))
    if stages - set(STAGES):
        raise SystemExit(f"--stages: unknown {sorted(stages - set(STAGES))}; choose from {', '.join(STAGES)}")
    results = {"device": ceilings(ns.device), "levels": levels, "models": {}}
    print(json.dumps(results["device"]), flush=True)
    for name, path in build_models(ns).items():
        vocab = json.loads((path / "config.json").read_text())["vocab_size"]
        r = results["models"][name] = {"decode_weight_bytes": decode_weight_bytes(path)}
        low = [c for c in levels if c <= 64]
        stage_runs = {
            "graphs-triton": lambda: with_triton(inprocess, path, levels, ns.device, False, vocab, graphs=True),
            "graphs": lambda: inprocess(path, levels, ns.device, False, vocab, graphs=True),
            "prefill-lengths": lambda: prefill_lengths(path, ns.device, vocab, (64, 256) if ns.tiny else
                                                       (256, 1024, 4096)),
            "served-graphs-triton": lambda: with_triton(served, path, name, low, ns.device, Path(ns.work), graphs=True),
            "served-graphs": lambda: served(path, name, low, ns.device, Path(ns.work), graphs=True),
            "compiled": lambda: inprocess(path, levels, ns.device, False, vocab),
            "hf": lambda: hf_generate(path, low, ns.device, vocab),
            "served": lambda: served(path, name, low, ns.device, Path(ns.work)),
            "eager": lambda: inprocess(path, [c for c in levels if c in (1, 64)] or levels, ns.device, True, vocab),
        }
        for key, run in stage_runs.items():
            if key not in stages:
                continue
            print(f"{name}: {key}", flush=True)
            start = time.perf_counter()
            try:
                r[key] = run()
            except Exception as e:  # one stage's failure is reported; the others still run
                r[key] = {"error": f"{type(e).__name__}: {e}"}
                print(f"  {key} FAILED: {r[key]['error']}", flush=True)
            r.setdefault("stage_s", {})[key] = time.perf_counter() - start
            (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    print(report(results), flush=True)
    (out / "report.md").write_text(report(results) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
