"""ascendserve in-process beside the optional in-process upper references of issue #5: OpenVINO GenAI and
onnxruntime-genai, on the demo model (SmolLM2-135M-Instruct), with no HTTP in between.

Neither reference serves OpenAI's API from PyPI (cpu_peers.md §2), so they are not in compare_cpu.py's tables: here
every engine gets the same C prompts of --input-len random token ids at once and generates --output-len tokens each
(EOS ignored, greedy), in its own process; the figure is output tokens / wall seconds of that one batch, after one
warm-up batch. ascendserve runs `LLM.generate` (continuous batching, its defaults: bf16 on a CPU with AMX), OpenVINO
`LLMPipeline` on an export with fp16 weights (computed in bf16 on AMX; its continuous-batching scheduler takes the C
prompts together), onnxruntime-genai static batches on its int4 (MatMulNBits) build, the form cpu_peers.md found
fastest for it (its generator takes at most 32 sequences: C=64 is two batches of 32 in turn). Each reference lives in
its own venv under --work-dir (peers.py installs it, this script exports the demo, on first use, ~3 min); the Qwen3.5
shape is not run: onnxruntime-genai's builder has no Qwen3.5 and OpenVINO's export
needs another transformers (5.2) and prefilled Qwen3.5 at ~69 tok/s in cpu_peers.md §4.

    .venv/bin/python benchmarks/inprocess_refs.py [--concurrency 1,8,16,64] [--engines ascendserve,openvino,ortgenai]
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import peers
from compare_models import prepare_demo
from peers import WorkDir

ENGINES = ("ascendserve", "openvino", "ortgenai")

# Run in the engine's own interpreter: argv = engine, model dir, prompts JSON, output length; prints {C: seconds}.
RUNNER = r'''
import json, sys, time
engine, model_dir, prompts_file, out_len = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
batches = {int(c): p for c, p in json.load(open(prompts_file)).items()}
if engine == "ascendserve":
    from ascendserve import LLM, SamplingParams
    llm = LLM(model_dir, max_model_len=1024, max_num_seqs=max(batches), max_num_batched_tokens=2048)
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    def run(prompts):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == out_len for o in outs)
elif engine == "openvino":
    import numpy as np, openvino as ov, openvino_genai as og
    pipe = og.LLMPipeline(model_dir, "CPU")
    config = og.GenerationConfig(max_new_tokens=out_len, min_new_tokens=out_len, ignore_eos=True, do_sample=False)
    config.apply_chat_template = False
    def run(prompts):
        ids = np.array(prompts, dtype=np.int64)
        inputs = og.TokenizedInputs(ov.Tensor(ids), ov.Tensor(np.ones_like(ids)))
        res = pipe.generate(inputs, config)
        generated = res.perf_metrics.get_num_generated_tokens()
        assert generated == out_len * len(prompts), generated
else:
    import numpy as np, onnxruntime_genai as og
    model = og.Model(model_dir)
    def run(prompts):  # its generator takes at most 32 sequences: larger levels run as batches of 32 in turn
        for b in range(0, len(prompts), 32):
            run_static(prompts[b:b + 32])
    def run_static(prompts):
        params = og.GeneratorParams(model)
        total = len(prompts[0]) + out_len
        params.set_search_options(max_length=total, min_length=total, batch_size=len(prompts), do_sample=False)
        gen = og.Generator(model, params)
        gen.append_tokens(np.array(prompts, dtype=np.int32))
        while not gen.is_done():
            gen.generate_next_token()
        assert all(len(gen.get_sequence(i)) == total for i in range(len(prompts)))
result = {}
for c, prompts in sorted(batches.items()):
    run([p[:64] for p in prompts])  # warm-up at this batch size
    start = time.perf_counter()
    run(prompts)
    result[c] = time.perf_counter() - start
print("RESULT " + json.dumps(result), flush=True)
'''


def export(work: WorkDir, engine: str, venv: Path, hf_dir: Path) -> Path:
    """The demo in the engine's format, made once: OpenVINO IR with fp16 weights, or an int4 ONNX build."""
    out = work.models / f"{hf_dir.name}-{'ov-fp16' if engine == 'openvino' else 'ort-int4'}"
    marker = out / ("openvino_model.xml" if engine == "openvino" else "genai_config.json")
    if marker.exists():
        return out
    python = venv / "bin" / "python"
    if engine == "openvino":
        cmd = [venv / "bin" / "optimum-cli", "export", "openvino", "--model", hf_dir, "--task",
               "text-generation-with-past", "--weight-format", "fp16", out]
    else:
        cmd = [python, "-m", "onnxruntime_genai.models.builder", "-i", hf_dir, "-o", out, "-p", "int4", "-e", "cpu"]
    print(f"Exporting {hf_dir.name} for {engine} into {out}", flush=True)
    peers.run_logged(cmd, work.logs / f"export-{engine}.log")
    return out


def prompt_batches(levels: list[int], input_len: int, vocab: int, seed: int) -> dict[int, list[list[int]]]:
    import random
    rng = random.Random(seed)
    return {c: [[rng.randrange(100, vocab - 100) for _ in range(input_len)] for _ in range(c)] for c in levels}


def run_engine(engine: str, python: Path, model_dir: Path, prompts_file: str, out_len: int, threads: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    if engine == "ascendserve":
        env.setdefault("LD_PRELOAD", "libtcmalloc_minimal.so.4")  # what `ascendserve` itself preloads on CPU
    proc = subprocess.run([python, "-c", RUNNER, engine, model_dir, prompts_file, str(out_len)], env=env,
                          capture_output=True, text=True)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        raise RuntimeError(f"{engine} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return {int(c): s for c, s in json.loads(line[len("RESULT "):]).items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work-dir", default="~/.cache/ascendserve/bench-peers", help="venvs, models, logs")
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--concurrency", default="1,8,16,64")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ns = p.parse_args()
    work = WorkDir(Path(ns.work_dir).expanduser())
    if not re.fullmatch(r"[1-9][0-9]*(,[1-9][0-9]*)*", ns.concurrency):
        p.error(f"--concurrency: comma-separated positive integers, e.g. 1,8,16,64 (got {ns.concurrency!r})")
    levels = [int(c) for c in ns.concurrency.split(",")]
    engines = ns.engines.split(",")
    if unknown := [e for e in engines if e not in ENGINES]:
        p.error(f"--engines: unknown {', '.join(unknown)}; choose from {', '.join(ENGINES)}")
    demo = prepare_demo(work)
    vocab = json.loads((demo.hf_dir / "config.json").read_text())["vocab_size"]
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(prompt_batches(levels, ns.input_len, vocab, ns.seed), f)
    results, versions = {}, {}
    for engine in engines:
        if engine == "ascendserve":
            python, model_dir = Path(sys.executable), demo.ascendserve_path  # the GGUF, as compare_cpu.py serves
            versions[engine] = peers.pip_versions(python.parent.parent, ["ascendserve", "torch"])
        else:
            venv = (peers.install_openvino if engine == "openvino" else peers.install_ortgenai)(work)
            python, model_dir = venv / "bin" / "python", export(work, engine, venv, demo.hf_dir)
            versions[engine] = peers.pip_versions(venv, ["openvino-genai", "openvino", "onnxruntime-genai",
                                                         "onnxruntime"])
        print(f"[{engine}] running C={ns.concurrency}", flush=True)
        try:
            results[engine] = run_engine(engine, python, model_dir, f.name, ns.output_len, ns.threads)
        except RuntimeError as e:  # reported in the table; the other engines still run
            print(e, flush=True)
            continue
        print(f"[{engine}] seconds per batch: {json.dumps(results[engine])}", flush=True)
    os.unlink(f.name)
    print(f"\ndemo in-process, {ns.input_len} in / {ns.output_len} out, output tok/s (one batch of C; ratio "
          f"ascendserve / engine)\n")
    print("| engine | " + " | ".join(f"C={c}" for c in levels) + " |")
    print("|---|" + "---|" * len(levels))
    for engine in engines:
        if engine not in results:
            print(f"| {engine} | " + " | ".join("failed" for _ in levels) + " |")
            continue
        cells = []
        for c in levels:
            tps = c * ns.output_len / results[engine][c]
            ratio = "" if engine == "ascendserve" or "ascendserve" not in results else \
                f" ({results[engine][c] / results['ascendserve'][c]:.2f}x)"
            cells.append(f"{tps:.1f}{ratio}")
        print(f"| {engine} | " + " | ".join(cells) + " |")
    print("\nversions: " + json.dumps(versions))


if __name__ == "__main__":
    main()
