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
    max_output_tokens_per_s: float = 0.0  # the busiest whole second of the run, one token per streamed chunk
    max_concurrent_requests: int = 0  # the most requests in flight during one whole second
    request_goodput: float | None = None  # requests/s that met every --goodput SLO (None: no SLO given)

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


def _peaks(done: list[RequestFuncOutput]) -> tuple[int, int]:
    """vLLM's peak output tokens in one second and peak requests in flight in one second, seconds counted
    from the first request's start; a request is in flight in every second from its start's to its end's."""
    if not done:
        return 0, 0
    first = min(out.start_time for out in done)
    seconds = int(max(out.start_time + out.latency for out in done) - first) + 1
    tokens, in_flight = np.zeros(seconds, dtype=np.int64), np.zeros(seconds, dtype=np.int64)
    for out in done:
        chunk_times = out.start_time + out.ttft + np.concatenate(([0.0], np.cumsum(out.itl)))
        np.add.at(tokens, np.minimum((chunk_times - first).astype(np.int64), seconds - 1), 1)
        in_flight[int(out.start_time - first):int(out.start_time + out.latency - first) + 1] += 1
    return int(tokens.max()), int(in_flight.max())


def _is_good(out: RequestFuncOutput, tpot: float, slo_ms: dict[str, float]) -> bool:
    """Whether a request met every SLO of `slo_ms` ({"ttft"|"tpot"|"e2el": ms}); TPOT is 0 for one token."""
    values = {"ttft": out.ttft, "tpot": tpot, "e2el": out.latency}
    return all(values[key] * 1000.0 <= limit for key, limit in slo_ms.items())


def calculate_metrics(outputs: list[RequestFuncOutput], duration: float,
                      percentiles: list[float] = (99,), goodput: dict[str, float] | None = None) -> BenchmarkMetrics:
    """Aggregate a run as vLLM does: TPOT only for requests with more than one output token.

    Input tokens count the dataset's prompt lengths of the successful requests. `goodput` holds SLOs in ms
    (vLLM's `--goodput ttft:500 tpot:50`); the goodput counts the successful requests that met all of them.
    """
    ttfts, tpots, itls, e2els = [], [], [], []
    total_input = total_output = completed = good = 0
    for out in outputs:
        if not out.success:
            continue
        completed += 1
        total_input += out.prompt_len
        total_output += out.output_len
        ttfts.append(out.ttft)
        e2els.append(out.latency)
        itls.extend(out.itl)
        tpot = (out.latency - out.ttft) / (out.output_len - 1) if out.output_len > 1 else 0.0
        if out.output_len > 1:
            tpots.append(tpot)
        good += bool(goodput) and _is_good(out, tpot, goodput)
    duration = max(duration, 1e-9)
    stats = {key: _summary(values, list(percentiles))
             for key, values in zip(("ttft", "tpot", "itl", "e2el"), (ttfts, tpots, itls, e2els))}
    max_tokens_per_s, max_in_flight = _peaks([out for out in outputs if out.success])
    return BenchmarkMetrics(
        completed=completed, failed=len(outputs) - completed, total_input=total_input, total_output=total_output,
        duration=duration, request_throughput=completed / duration, output_throughput=total_output / duration,
        total_token_throughput=(total_input + total_output) / duration, stats=stats,
        max_output_tokens_per_s=max_tokens_per_s, max_concurrent_requests=max_in_flight,
        request_goodput=good / duration if goodput else None)
