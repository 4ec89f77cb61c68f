"""What one benchmark request measured, and vLLM's serving metrics computed from a run of them.

Torch-free. Times are seconds from `time.perf_counter()`; the metrics report milliseconds.
Worked example: a request sent at 0.0 whose token chunks arrive at 0.1, 0.3, 0.6 has
ttft = 0.1, itl = [0.2, 0.3], latency = 0.6 and (3 output tokens) tpot = (0.6 - 0.1) / 2 = 0.25.
"""

from dataclasses import dataclass, field

import numpy as np

# The metrics with a mean/median/percentile block in the report, in vLLM's order: (key, name, header).
METRIC_BLOCKS = [
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
]


@dataclass
class RequestFuncOutput:
    """One request's measurements (vLLM's name); `output_tokens` is None when the server sent no usage."""

    success: bool = False
    prompt_len: int = 0
    output_tokens: int | None = None
    num_chunks: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0
    generated_text: str = ""
    server_prompt_tokens: int | None = None
    finish_reason: str | None = None  # the stream's last one
    error: str = ""

    @property
    def output_len(self) -> int:
        """Generated tokens: the usage count when the server gave one, else the token chunks received."""
        return self.output_tokens if self.output_tokens is not None else self.num_chunks


@dataclass
class BenchmarkMetrics:
    """vLLM's BenchmarkMetrics: totals, throughputs, and per metric mean/median/std/percentiles in ms."""

    completed: int
    failed: int
    total_input: int
    total_output: int
    duration: float
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    # {"ttft": {"mean": ms, "median": ms, "std": ms, "p99": ms, ...}, "tpot": ..., "itl": ..., "e2el": ...}
    stats: dict[str, dict[str, float]]

    def flat(self) -> dict[str, float]:
        """vLLM's flat result keys: mean_ttft_ms, median_ttft_ms, std_ttft_ms, p99_ttft_ms, ..."""
        return {f"{stat}_{key}_ms": value for key, block in self.stats.items() for stat, value in block.items()}


def percentile_label(p: float) -> str:
    """99 -> "p99", 99.9 -> "p99.9" (vLLM's key spelling)."""
    return f"p{int(p)}" if int(p) == p else f"p{p}"


def _summary(values: list[float], percentiles: list[float]) -> dict[str, float]:
    data = np.asarray(values if values else [0.0], dtype=np.float64) * 1000.0
    out = {"mean": float(np.mean(data)), "median": float(np.median(data)), "std": float(np.std(data))}
    for p in percentiles:
        out[percentile_label(p)] = float(np.percentile(data, p))
    return out


def calculate_metrics(outputs: list[RequestFuncOutput], duration: float,
                      percentiles: list[float] = (99,)) -> BenchmarkMetrics:
    """Aggregate a run as vLLM does: TPOT only for requests with more than one output token.

    Input tokens count the dataset's prompt lengths of the successful requests.
    """
    ttfts, tpots, itls, e2els = [], [], [], []
    total_input = total_output = completed = 0
    for out in outputs:
        if not out.success:
            continue
        completed += 1
        total_input += out.prompt_len
        total_output += out.output_len
        ttfts.append(out.ttft)
        e2els.append(out.latency)
        itls.extend(out.itl)
        if out.output_len > 1:
            tpots.append((out.latency - out.ttft) / (out.output_len - 1))
    duration = max(duration, 1e-9)
    stats = {key: _summary(values, list(percentiles))
             for key, values in zip(("ttft", "tpot", "itl", "e2el"), (ttfts, tpots, itls, e2els))}
    return BenchmarkMetrics(
        completed=completed, failed=len(outputs) - completed, total_input=total_input, total_output=total_output,
        duration=duration, request_throughput=completed / duration, output_throughput=total_output / duration,
        total_token_throughput=(total_input + total_output) / duration, stats=stats)
