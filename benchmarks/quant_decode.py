"""Single-stream decode tok/s of the demo model (SmolLM2-135M GGUF) unquantized vs int8 vs int4.

One request, 64 generated tokens (ignore_eos), after one warm-up request; each mode in turn.

    .venv/bin/python benchmarks/quant_decode.py [--modes none,int8,int4] [--tokens 64] [--reps 3]
"""

import argparse
import time

from ascendserve import LLM, SamplingParams


def decode_tok_s(llm: LLM, tokens: int) -> float:
    """Generated tokens per second of one request, minus its 1-token time (prefill and overhead)."""
    prompt = [{"prompt_token_ids": list(range(100, 116))}]

    def timed(n: int) -> float:
        start = time.perf_counter()
        llm.generate(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - start

    timed(tokens)  # warm-up
    return (tokens - 1) / (timed(tokens) - timed(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="none,int8,int4")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    ns = parser.parse_args()
    for mode in ns.modes.split(","):
        llm = LLM(quantization=None if mode == "none" else mode)
        runs = sorted(decode_tok_s(llm, ns.tokens) for _ in range(ns.reps))
        print(f"{mode:>5}: decode {runs[len(runs) // 2]:.1f} tok/s (median of {ns.reps}; max {runs[-1]:.1f})",
              flush=True)
        del llm


if __name__ == "__main__":
    main()
