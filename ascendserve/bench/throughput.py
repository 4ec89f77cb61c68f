"""`bench throughput`: offline generation of N random-token requests with `LLM.generate`, ignore_eos.

Lengths are vLLM's (`--input-len`/`--output-len` with `--random-range-ratio`) or nano-vllm's
(`--min-len`/`--max-len`: input and output lengths each uniform in [min, max]).
"""

import json
import os
import time
from dataclasses import asdict, dataclass

import numpy as np


@dataclass
class ThroughputResult:
    """vLLM's throughput JSON keys."""

    elapsed_time: float
    num_requests: int
    total_num_tokens: int
    total_prompt_tokens: int
    total_output_tokens: int
    requests_per_second: float
    tokens_per_second: float
    output_tokens_per_second: float


def workload(num_prompts: int, vocab_size: int, input_len: int, output_len: int, range_ratio: float = 0.0,
             min_len: int | None = None, max_len: int | None = None,
             seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """(prompt token ids, output lengths): nano-vllm's uniform [min_len, max_len] when given, else vLLM's."""
    rng = np.random.default_rng(seed)
    if min_len is not None or max_len is not None:
        if min_len is None or max_len is None or not 1 <= min_len <= max_len:
            raise ValueError(f"--min-len and --max-len go together with 1 <= min <= max, got {min_len}, {max_len}")
        in_lens = rng.integers(min_len, max_len + 1, size=num_prompts)
        out_lens = rng.integers(min_len, max_len + 1, size=num_prompts)
    else:
        if not 0 <= range_ratio < 1:
            raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
        in_lens = rng.integers(int(input_len * (1 - range_ratio)), int(input_len * (1 + range_ratio)) + 1,
                               size=num_prompts)
        out_lens = rng.integers(int(output_len * (1 - range_ratio)), int(output_len * (1 + range_ratio)) + 1,
                                size=num_prompts)
    prompts = [rng.integers(0, vocab_size, size=max(1, int(n))).tolist() for n in in_lens]
    return prompts, [max(1, int(n)) for n in out_lens]


def run_throughput(llm, prompts: list[list[int]], output_lens: list[int], n: int = 1,
                   detokenize: bool = True) -> ThroughputResult:
    """Generate every request once, `n` sequences each (after a one-request warm-up on a prompt of its own: a measured
    one would be a prefix-cache hit), and time the whole batch."""
    from ascendserve import SamplingParams
    warmup = [(token + 1) % llm.llm_engine.vocab_size for token in prompts[0]]
    llm.generate([{"prompt_token_ids": warmup}], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    params = [SamplingParams(n=n, temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=length,
                             detokenize=detokenize) for length in output_lens]
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    prompt_tokens = sum(len(p) for p in prompts)
    output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    total = prompt_tokens + output_tokens
    return ThroughputResult(elapsed, len(prompts), total, prompt_tokens, output_tokens, len(prompts) / elapsed,
                            total / elapsed, output_tokens / elapsed)


def format_throughput(r: ThroughputResult) -> str:
    """vLLM's summary lines."""
    return (f"Throughput: {r.requests_per_second:.2f} requests/s, {r.tokens_per_second:.2f} total tokens/s, "
            f"{r.output_tokens_per_second:.2f} output tokens/s\n"
            f"Total num prompt tokens:  {r.total_prompt_tokens}\n"
            f"Total num output tokens:  {r.total_output_tokens}")


def save_json(data: dict, path: str) -> None:
    """Write a result dictionary as indented JSON, making its directory if it is not there."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)


def throughput_dict(r: ThroughputResult) -> dict:
    """The result as a JSON-ready dictionary."""
    return asdict(r)
