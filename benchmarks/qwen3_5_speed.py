"""Qwen3.5-0.8B-shaped random model: prefill tok/s (512-token prompt) and decode tok/s at 1, 8, 32 streams.

ascendserve (continuous batching, paged KV + state slots) against transformers' plain `generate`
(batched where it can: same-length prompts, so no padding) in the same run.

    .venv/bin/python benchmarks/qwen3_5_speed.py [--dtype float32] [--concurrency 1,8,32]
"""

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time

import torch

QWEN3_5_08B = dict(vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
                   num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
                   linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
                   linear_conv_kernel_dim=4, full_attention_interval=4, rms_norm_eps=1e-6,
                   max_position_embeddings=262144, tie_word_embeddings=True,
                   # as the real checkpoints declare it: vLLM keeps the recurrent state in fp32 only where the config
                   # says so (its "auto" is the model dtype otherwise), ascendserve in fp32 either way
                   mamba_ssm_dtype="float32",
                   rope_parameters={"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                                    "mrope_section": [11, 11, 10], "mrope_interleaved": True})


def checkpoint(work: str) -> str:
    """A random-weight Qwen3_5ForCausalLM with the 0.8B shape (bf16 safetensors), built once."""
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_5 import Qwen3_5TextConfig
    path = os.path.join(work, "qwen3_5-0.8b-random")
    if not os.path.exists(os.path.join(path, "config.json")):
        config = Qwen3_5TextConfig(**QWEN3_5_08B, architectures=["Qwen3_5ForCausalLM"])
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(path)
    return path


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1000, 200000, (n,), generator=g).tolist()


def ours(path: str, dtype: str, concurrency: list[int], prompt_len: int, decode_len: int) -> dict:
    from ascendserve import LLM, SamplingParams
    llm = LLM(path, skip_tokenizer_init=True, dtype=dtype, max_model_len=prompt_len + decode_len + 8,
              kv_cache_memory_bytes=2 << 30, max_num_seqs=max(concurrency), max_num_batched_tokens=2048)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate({"prompt_token_ids": prompt(64, 0)}, one, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    llm.generate({"prompt_token_ids": prompt(prompt_len, 1)}, one, use_tqdm=False)
    result = {"prefill_tps": prompt_len / (time.perf_counter() - start)}
    for c in concurrency:
        result[f"decode_tps_{c}"] = _decode_rate(llm, c, decode_len)
    return result


def _decode_rate(llm, streams: int, decode_len: int) -> float:
    """Generated tokens per second once every stream is decoding (prefill steps excluded)."""
    from ascendserve import SamplingParams
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=decode_len, ignore_eos=True)
    for i in range(streams):
        engine.add_request(f"d{streams}-{i}", {"prompt_token_ids": prompt(32, 100 + i)}, params)
    while any(r.num_output_tokens == 0 for r in engine.scheduler.requests.values()):
        engine.step()
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return streams * (decode_len - 1) / (time.perf_counter() - start)


@torch.inference_mode()
def transformers_speed(path: str, dtype: torch.dtype, concurrency: list[int], prompt_len: int, decode_len: int) -> dict:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    model.generation_config.eos_token_id = None
    model(torch.tensor([prompt(64, 0)]))  # warm-up
    start = time.perf_counter()
    model(torch.tensor([prompt(prompt_len, 1)]))
    result = {"prefill_tps": prompt_len / (time.perf_counter() - start)}
    for c in concurrency:
        ids = torch.tensor([prompt(32, 100 + i) for i in range(c)])
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=0)
        prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=decode_len, do_sample=False, pad_token_id=0)
        result[f"decode_tps_{c}"] = c * (decode_len - 1) / (time.perf_counter() - t0 - prefill)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--decode-len", type=int, default=32)
    ap.add_argument("--work-dir", default=os.path.join(tempfile.gettempdir(), "ascendserve-bench"))
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    path = checkpoint(args.work_dir)
    a = ours(path, args.dtype, levels, args.prompt_len, args.decode_len)
    print("ascendserve", a, flush=True)
    t = transformers_speed(path, getattr(torch, args.dtype), levels, args.prompt_len, args.decode_len)
    print("transformers", t, flush=True)
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"\n## Qwen3.5-0.8B shape, random weights, {args.dtype}\n")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"git {git}")
    print(f"command: {' '.join([os.path.basename(sys.executable)] + sys.argv)}\n")
    print("| metric | ascendserve | transformers | ratio |\n|---|---|---|---|")
    for key in a:
        label = f"prefill tok/s ({args.prompt_len}-token prompt)" if key == "prefill_tps" else \
            f"decode tok/s, {key.rsplit('_', 1)[1]} streams"
        print(f"| {label} | {a[key]:.1f} | {t[key]:.1f} | {a[key] / t[key]:.2f}x |")


if __name__ == "__main__":
    main()
