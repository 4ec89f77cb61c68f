"""One model in one dtype, in-process: seconds per 8 x 256-token prefill (two tries) and median ms per decode step
once 1, 8 and 64 streams (128-token prompts) decode. Run it once per dtype (a process each) to choose `--dtype`.

    .venv/bin/python benchmarks/probe_dtype_steps.py demo float32
    .venv/bin/python benchmarks/probe_dtype_steps.py PATH_TO_HF_DIR bfloat16 [--mamba-ssm-cache-dtype bfloat16]
        [--quantization int4]
"""

import argparse
import json
import time

import torch

from ascendserve import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="'demo' or a checkpoint path")
    ap.add_argument("dtype", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--decode-tokens", type=int, default=24)
    ap.add_argument("--mamba-ssm-cache-dtype", default="auto", help="a hybrid model's recurrent-state dtype")
    ap.add_argument("--quantization", default=None, help="weight-only int8 / int4 (applied at load)")
    args = ap.parse_args()
    demo = args.model == "demo"
    llm = LLM(None if demo else args.model, skip_tokenizer_init=not demo, dtype=args.dtype, max_model_len=600,
              kv_cache_memory_bytes=2 << 30, max_num_seqs=64, max_num_batched_tokens=2048,
              mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype, quantization=args.quantization)
    vocab = llm.llm_engine.config.hf_config.get_text_config().vocab_size

    def prompt(n: int, seed: int) -> list[int]:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(100, vocab - 100, (n,), generator=g).tolist()

    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate({"prompt_token_ids": prompt(64, 0)}, one, use_tqdm=False)  # warm-up
    result = {"prefill_8x256_s": []}
    for rep in range(2):
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt(256, 1 + i + 10 * rep)} for i in range(8)], one, use_tqdm=False)
        result["prefill_8x256_s"].append(round(time.perf_counter() - start, 2))
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=args.decode_tokens, ignore_eos=True)
    for streams in (1, 8, 64):
        for i in range(streams):
            engine.add_request(f"d{streams}-{i}", {"prompt_token_ids": prompt(128, 100 + i)}, params)
        while any(r.num_output_tokens == 0 for r in engine.scheduler.requests.values()):
            engine.step()
        times = []
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        times.sort()
        result[f"step_ms_{streams}"] = round(1e3 * times[len(times) // 2], 1)
    print(args.model, args.dtype, f"ssm={args.mamba_ssm_cache_dtype}", f"quantization={args.quantization}",
          json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
