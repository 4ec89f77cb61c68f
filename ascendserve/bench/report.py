"""`bench serve`'s printed report and JSON result, in vLLM's layout and with vLLM's keys."""

import json
import os
from datetime import datetime

from ascendserve.bench.metrics import METRIC_BLOCKS, BenchmarkMetrics, RequestFuncOutput, percentile_label


def _line(label: str, value, fmt: str = "") -> str:
    return "{:<40} {:<10{}}".format(label, value, fmt)


def format_report(m: BenchmarkMetrics, max_concurrency: int | None = None,
                  request_rate: float = float("inf"), percentiles: list[float] = (99,),
                  metrics: list[str] = ("ttft", "tpot", "itl", "e2el")) -> str:
    """The `============ Serving Benchmark Result ============` block of `vllm bench serve`."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="),
             _line("Successful requests:", m.completed), _line("Failed requests:", m.failed)]
    if max_concurrency is not None:
        lines.append(_line("Maximum request concurrency:", max_concurrency))
    if request_rate != float("inf"):
        lines.append(_line("Request rate configured (RPS):", request_rate, ".2f"))
    lines += [_line("Benchmark duration (s):", m.duration, ".2f"),
              _line("Total input tokens:", m.total_input),
              _line("Total generated tokens:", m.total_output),
              _line("Request throughput (req/s):", m.request_throughput, ".2f")]
    if m.request_goodput is not None:
        lines.append(_line("Request goodput (req/s):", m.request_goodput, ".2f"))
    lines += [_line("Output token throughput (tok/s):", m.output_throughput, ".2f"),
              _line("Peak output token throughput (tok/s):", m.max_output_tokens_per_s, ".2f"),
              _line("Peak concurrent requests:", m.max_concurrent_requests, ".2f"),
              _line("Total Token throughput (tok/s):", m.total_token_throughput, ".2f")]
    for key, name, header in METRIC_BLOCKS:
        if key not in metrics:
            continue
        stats = m.stats[key]
        lines += ["{s:{c}^{n}}".format(s=header, n=50, c="-"),
                  _line(f"Mean {name} (ms):", stats["mean"], ".2f"),
                  _line(f"Median {name} (ms):", stats["median"], ".2f")]
        lines += [_line(f"P{percentile_label(p)[1:]} {name} (ms):", stats[percentile_label(p)], ".2f")
                  for p in percentiles]
    lines.append("=" * 50)
    return "\n".join(lines)


def result_json(m: BenchmarkMetrics, outputs: list[RequestFuncOutput], *, model_id: str, endpoint: str,
                base_url: str, num_prompts: int, request_rate: float, max_concurrency: int | None,
                burstiness: float = 1.0, tokenizer_id: str | None = None, dataset: str = "random") -> dict:
    """vLLM's result dictionary: run settings, totals, throughputs, latency stats and per-request lists."""
    backend = "openai-chat" if endpoint.endswith("chat/completions") else "openai"
    result = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": backend, "endpoint_type": backend,
        "base_url": base_url, "endpoint": endpoint, "dataset_name": dataset, "model_id": model_id,
        "tokenizer_id": tokenizer_id, "num_prompts": num_prompts,
        "request_rate": request_rate if request_rate != float("inf") else "inf",
        "burstiness": burstiness, "max_concurrency": max_concurrency, "duration": m.duration,
        "completed": m.completed, "failed": m.failed, "total_input_tokens": m.total_input,
        "total_output_tokens": m.total_output, "request_throughput": m.request_throughput,
        "request_goodput": m.request_goodput, "output_throughput": m.output_throughput,
        "max_output_tokens_per_s": m.max_output_tokens_per_s, "max_concurrent_requests": m.max_concurrent_requests,
        "total_token_throughput": m.total_token_throughput,
    }
    result.update(m.flat())
    result.update({
        "input_lens": [o.prompt_len for o in outputs],
        "output_lens": [o.output_len if o.success else 0 for o in outputs],
        "server_input_lens": [o.server_prompt_tokens for o in outputs],
        "ttfts": [o.ttft for o in outputs], "itls": [o.itl for o in outputs],
        "e2els": [o.latency for o in outputs],
        "start_times": [o.start_time - min((x.start_time for x in outputs), default=0.0) for o in outputs],
        "generated_texts": [o.generated_text for o in outputs], "errors": [o.error for o in outputs],
    })
    return result


def default_result_filename(result: dict) -> str:
    """vLLM's name: `{backend}-{rate}qps[-concurrency{C}]-{model}-{date}.json`."""
    concurrency = f"-concurrency{result['max_concurrency']}" if result["max_concurrency"] is not None else ""
    model = str(result["model_id"]).rstrip("/").split("/")[-1]
    return f"{result['backend']}-{result['request_rate']}qps{concurrency}-{model}-{result['date']}.json"


def save_result(result: dict, result_dir: str | None, filename: str | None) -> str:
    """Write the result JSON; return its path."""
    path = os.path.join(result_dir or ".", filename or default_result_filename(result))
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    return path
