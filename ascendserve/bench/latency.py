"""`bench latency`: one batch of `batch_size` random prompts run to `output_len` tokens, timed per phase.

Each iteration drives `LLMEngine.step()` directly. Prefill time ends at the first step after which every
request has produced a token (several steps when chunked prefill splits the batch); the remaining steps
are decode steps. Worked example: steps end at 0.50, 0.52, 0.54 s for 3 output tokens -> prefill 0.50 s,
2 decode steps, 10 ms per decode step, latency 0.54 s.
"""

import time
from dataclasses import dataclass

import numpy as np

PERCENTILES = [10, 25, 50, 75, 90, 99]


@dataclass
class IterationTiming:
    """One batch's phases, in seconds."""

    latency: float
    prefill: float
    decode_steps: int

    @property
    def decode_per_step(self) -> float:
        """Mean time of one decode step (0 when there was none)."""
        return (self.latency - self.prefill) / self.decode_steps if self.decode_steps else 0.0


def run_batch(engine, prompts: list[list[int]], output_len: int, n: int = 1,
              detokenize: bool = True) -> IterationTiming:
    """Add every prompt (`n` sequences each), step until all finish, and time prefill and decode."""
    from ascendserve import SamplingParams
    params = SamplingParams(n=n, temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=output_len,
                            detokenize=detokenize)
    started: set[str] = set()
    start = time.perf_counter()
    ids = []
    for prompt in prompts:
        ids.append(engine.next_request_id())
        engine.add_request(ids[-1], {"prompt_token_ids": prompt}, params)
    prefill_end, decode_steps = None, 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        if prefill_end is not None:
            decode_steps += 1
            continue
        started.update(o.request_id for o in outputs if o.outputs and o.outputs[0].token_ids)
        if len(started) == len(ids):
            prefill_end = time.perf_counter()
    end = time.perf_counter()
    return IterationTiming(end - start, (prefill_end or end) - start, decode_steps)


def run_latency(engine, batch_size: int, input_len: int, output_len: int, num_iters: int,
                num_iters_warmup: int, seed: int = 0, n: int = 1, detokenize: bool = True) -> list[IterationTiming]:
    """Warm up, then time `num_iters` batches of the same shape. Each batch has prompts of its own: a repeated one
    would be a prefix-cache hit (prefix caching is on by default), timing no prefill at all."""
    rng = np.random.default_rng(seed)

    def prompts() -> list[list[int]]:
        return [rng.integers(0, engine.vocab_size, size=input_len).tolist() for _ in range(batch_size)]

    for _ in range(num_iters_warmup):
        run_batch(engine, prompts(), output_len, n, detokenize)
    return [run_batch(engine, prompts(), output_len, n, detokenize) for _ in range(num_iters)]


def latency_summary(timings: list[IterationTiming]) -> dict:
    """vLLM's latency JSON (avg_latency, latencies, percentiles) plus the prefill/decode split."""
    latencies = np.array([t.latency for t in timings])
    return {
        "avg_latency": float(latencies.mean()),
        "latencies": latencies.tolist(),
        "percentiles": {str(p): float(np.percentile(latencies, p)) for p in PERCENTILES},
        "avg_prefill_time": float(np.mean([t.prefill for t in timings])),
        "avg_decode_time_per_step": float(np.mean([t.decode_per_step for t in timings])),
        "decode_steps": [t.decode_steps for t in timings],
    }


def format_latency(summary: dict, batch_size: int) -> str:
    """vLLM's `Avg latency` and percentile lines, after the prefill and decode split."""
    lines = [f"Avg prefill time: {summary['avg_prefill_time']:.4f} seconds ({batch_size} prompts)",
             f"Avg decode time per step: {summary['avg_decode_time_per_step'] * 1000:.2f} ms",
             f"Avg latency: {summary['avg_latency']:.4f} seconds"]
    lines += [f"{p}% percentile latency: {v:.4f} seconds" for p, v in summary["percentiles"].items()]
    return "\n".join(lines)
