"""Offline throughput, nano-vllm's protocol scaled to this machine: ascendserve vs transformers generate.

N requests, prompt and output lengths uniform in [min_len, max_len], random token ids, ignore_eos.
Output tok/s = requested output tokens / wall time. transformers runs padded (left-padded) batches
with `generate` at each batch size given; its best is reported.

    .venv/bin/python benchmarks/offline_throughput.py --models demo,qwen3-0.6b
"""

import argparse
import os
import platform
import random
import subprocess
import sys
import tempfile
import time

import torch

MODELS = ("demo", "qwen3-0.6b")


def workload(n: int, lo: int, hi: int, vocab: int, seed: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, vocab - 100) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
    outs = [rng.randint(lo, hi) for _ in range(n)]
    return prompts, outs


def qwen3_06b_dir(work: str) -> str:
    """A random-weight Qwen3-0.6B-shaped checkpoint (bf16 safetensors), built once under `work`."""
    from transformers import AutoModelForCausalLM, Qwen3Config
    path = os.path.join(work, "qwen3-0.6b-random")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    config = Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                         num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                         max_position_embeddings=40960, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                         tie_word_embeddings=True, architectures=["Qwen3ForCausalLM"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path)
    return path


def run_ascendserve(model: str | None, prompts, outs, dtype: str) -> float:
    from ascendserve import LLM, SamplingParams
    llm = LLM(model, dtype=dtype, skip_tokenizer_init=model is not None, max_model_len=1024,
              kv_cache_memory_bytes=2 << 30)
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for o in outs]
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - start


def load_hf(model: str | None, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM
    if model is None:
        from ascendserve.loader.demo import get_demo_model_path
        directory, name = os.path.split(get_demo_model_path())
        return AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=dtype).eval()
    return AutoModelForCausalLM.from_pretrained(model, dtype=dtype).eval()


@torch.inference_mode()
def run_transformers(model, prompts, outs, batch_size: int) -> float:
    model.generation_config.eos_token_id = None
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch, want = prompts[i:i + batch_size], outs[i:i + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        model.generate(ids, attention_mask=mask, max_new_tokens=max(want), do_sample=False, pad_token_id=0)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--hf-batch-sizes", default="16,64")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--work-dir", default=os.path.join(tempfile.gettempdir(), "ascendserve-bench"))
    ap.add_argument("--skip-transformers", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.work_dir, exist_ok=True)
    torch_dtype = getattr(torch, args.dtype)
    rows = []
    for name in args.models.split(","):
        model = None if name == "demo" else qwen3_06b_dir(args.work_dir)
        vocab = 49152 if name == "demo" else 151936
        prompts, outs = workload(args.num_requests, args.min_len, args.max_len, vocab, seed=0)
        total = sum(outs)
        ours = run_ascendserve(model, prompts, outs, args.dtype)
        row = {"model": name, "requests": len(prompts), "output_tokens": total, "ascendserve_s": ours,
               "ascendserve_tps": total / ours}
        if not args.skip_transformers:
            hf = load_hf(model, torch_dtype)
            times = {bs: run_transformers(hf, prompts, outs, int(bs)) for bs in args.hf_batch_sizes.split(",")}
            best = min(times, key=times.get)
            row.update(hf_best_batch=best, hf_s=times[best], hf_tps=total / times[best],
                       ratio=times[best] / ours)
            del hf
        rows.append(row)
        print(row, flush=True)
    print_table(rows, args)


def print_table(rows, args) -> None:
    print(f"\n## Offline throughput ({args.num_requests} requests, lengths U[{args.min_len},{args.max_len}], "
          f"{args.dtype}, ignore_eos)\n")
    git = subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], capture_output=True, text=True).stdout.strip()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"git {git}")
    print(f"command: {' '.join([os.path.basename(sys.executable)] + sys.argv)}\n")
    print("| model | output tokens | ascendserve s | ascendserve tok/s | transformers best bs | transformers tok/s "
          "| ratio |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['output_tokens']} | {r['ascendserve_s']:.1f} | {r['ascendserve_tps']:.1f} | "
              f"{r.get('hf_best_batch', '-')} | {r.get('hf_tps', float('nan')):.1f} | "
              f"{r.get('ratio', float('nan')):.2f}x |")


if __name__ == "__main__":
    main()
