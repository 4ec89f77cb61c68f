"""Serving metrics from synthetic timestamps (exact), the printed report, the JSON result and the plots."""

import json
import os

import numpy as np
import pytest

from ascendserve.bench.metrics import RequestFuncOutput, calculate_metrics
from ascendserve.bench.report import default_result_filename, format_report, result_json, save_result


def _request(start: float, chunk_times: list[float], prompt_len: int, usage: int | None = None) -> RequestFuncOutput:
    """A successful request whose token chunks arrived at `chunk_times` (absolute seconds)."""
    itl = [b - a for a, b in zip(chunk_times, chunk_times[1:])]
    return RequestFuncOutput(success=True, prompt_len=prompt_len, output_tokens=usage, num_chunks=len(chunk_times),
                             ttft=chunk_times[0] - start, itl=itl, latency=chunk_times[-1] - start,
                             start_time=start, generated_text="x" * len(chunk_times))


@pytest.fixture
def outputs() -> list[RequestFuncOutput]:
    return [
        # ttft 0.1, itl [0.2, 0.3], e2e 0.6, tpot (0.6-0.1)/2 = 0.25; counted from chunks
        _request(0.0, [0.1, 0.3, 0.6], prompt_len=10),
        # ttft 0.2, itl [0.1], e2e 0.5 (0.7-0.2), usage says 5 tokens -> tpot (0.5-0.2)/4 = 0.075
        _request(0.2, [0.4, 0.5, 0.7], prompt_len=20, usage=5),
        # one token: ttft = e2e = 0.4, no TPOT, no ITL
        _request(0.5, [0.9], prompt_len=30),
        RequestFuncOutput(success=False, prompt_len=40, error="HTTP 503"),
    ]


def test_metrics_exact(outputs):
    m = calculate_metrics(outputs, duration=2.0, percentiles=[50, 99])
    assert (m.completed, m.failed, m.total_input, m.total_output) == (3, 1, 60, 9)
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(4.5)
    assert m.total_token_throughput == pytest.approx(34.5)
    ttft, tpot, itl, e2el = (m.stats[k] for k in ("ttft", "tpot", "itl", "e2el"))
    assert ttft["mean"] == pytest.approx(700 / 3) and ttft["median"] == pytest.approx(200)
    assert ttft["p99"] == pytest.approx(np.percentile([100, 200, 400], 99))
    assert tpot["mean"] == pytest.approx((250 + 75) / 2) and tpot["median"] == pytest.approx(162.5)
    assert itl["mean"] == pytest.approx(200) and itl["p50"] == pytest.approx(200)
    assert itl["p99"] == pytest.approx(np.percentile([200, 300, 100, 200], 99))
    assert e2el["mean"] == pytest.approx(500) and e2el["median"] == pytest.approx(500)
    assert m.flat()["median_tpot_ms"] == pytest.approx(162.5)


def test_peaks_and_goodput(outputs):
    """vLLM's peak tokens/s and requests in flight (per whole second) and the goodput under SLOs in ms."""
    m = calculate_metrics(outputs, duration=2.0)
    assert (m.max_output_tokens_per_s, m.max_concurrent_requests, m.request_goodput) == (7, 3, None)
    late = _request(1.5, [1.6, 2.2, 2.7], prompt_len=5)  # in flight in seconds 1 and 2; its chunks in 1, 2, 2
    m = calculate_metrics([*outputs, late], duration=3.0)
    assert (m.max_output_tokens_per_s, m.max_concurrent_requests) == (7, 3)
    # Seconds count from the first start (1.5): chunks in seconds 0, 0, 1 and 0, 1; both in flight in 0 and 1.
    m = calculate_metrics([late, _request(1.9, [2.1, 2.6], prompt_len=5)], duration=3.0)
    assert (m.max_output_tokens_per_s, m.max_concurrent_requests) == (3, 2)
    # ttft ms: 100, 200, 400; tpot ms: 250, 75, 0 (one token); e2el ms: 600, 500, 400
    assert calculate_metrics(outputs, 2.0, goodput={"ttft": 200}).request_goodput == pytest.approx(1.0)
    assert calculate_metrics(outputs, 2.0, goodput={"ttft": 400, "tpot": 100}).request_goodput == pytest.approx(1.0)
    assert calculate_metrics(outputs, 2.0, goodput={"e2el": 1000}).request_goodput == pytest.approx(1.5)
    assert calculate_metrics(outputs, 2.0, goodput={"tpot": 10}).request_goodput == pytest.approx(0.5)


def test_no_success_gives_zero_stats():
    m = calculate_metrics([RequestFuncOutput(error="boom")], duration=1.0)
    assert (m.completed, m.failed, m.stats["ttft"]["mean"], m.stats["e2el"]["p99"]) == (0, 1, 0.0, 0.0)


def test_report_layout(outputs):
    text = format_report(calculate_metrics(outputs, 2.0), max_concurrency=2)
    lines = text.splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============"
    assert lines[-1] == "=" * 50
    assert "Successful requests:                     3         " in lines
    assert "Failed requests:                         1         " in lines
    assert "Maximum request concurrency:             2         " in lines
    assert "Benchmark duration (s):                  2.00      " in lines
    assert "Total input tokens:                      60        " in lines
    assert "Total generated tokens:                  9         " in lines
    assert "Request throughput (req/s):              1.50      " in lines
    assert "Output token throughput (tok/s):         4.50      " in lines
    assert "Total Token throughput (tok/s):          34.50     " in lines
    assert "Peak output token throughput (tok/s):    7.00      " in lines
    assert "Peak concurrent requests:                3.00      " in lines
    assert "Request goodput" not in text
    assert "Request goodput (req/s):                 1.00      " in format_report(
        calculate_metrics(outputs, 2.0, goodput={"ttft": 200})).splitlines()
    assert "---------------Time to First Token----------------" in lines
    assert "-----Time per Output Token (excl. 1st token)------" in lines
    assert "Mean TPOT (ms):                          162.50    " in lines
    assert "Median E2EL (ms):                        500.00    " in lines
    assert any(line.startswith("P99 ITL (ms):") for line in lines)
    assert "Request rate configured" not in text
    assert "Request rate configured (RPS):           4.00" in format_report(
        calculate_metrics(outputs, 2.0), request_rate=4.0)


def test_result_json_and_file(outputs, tmp_path):
    m = calculate_metrics(outputs, 2.0)
    result = result_json(m, outputs, model_id="org/demo", endpoint="/v1/completions", base_url="http://x",
                         num_prompts=4, request_rate=float("inf"), max_concurrency=2)
    for key in ("date", "backend", "model_id", "num_prompts", "request_rate", "max_concurrency", "duration",
                "completed", "total_input_tokens", "total_output_tokens", "request_throughput",
                "output_throughput", "total_token_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
                "mean_tpot_ms", "p99_itl_ms", "median_e2el_ms", "std_e2el_ms", "ttfts", "itls", "input_lens",
                "request_goodput", "max_output_tokens_per_s", "max_concurrent_requests",
                "output_lens", "generated_texts", "errors"):
        assert key in result, key
    assert result["backend"] == "openai" and result["request_rate"] == "inf"
    assert result["output_lens"] == [3, 5, 1, 0] and result["input_lens"] == [10, 20, 30, 40]
    assert result["errors"][3] == "HTTP 503"
    assert default_result_filename(result).startswith("openai-infqps-concurrency2-demo-")
    path = save_result(result, str(tmp_path / "out"), None)
    assert os.path.dirname(path) == str(tmp_path / "out")
    assert json.loads(open(path).read())["completed"] == 3


def test_plots(outputs, tmp_path):
    pytest.importorskip("matplotlib")
    from ascendserve.bench.plot import plot_requests, plot_sweep
    results = []
    for c in (1, 4, 16):
        r = result_json(calculate_metrics(outputs, 2.0 / c), outputs, model_id="demo", endpoint="/v1/completions",
                        base_url="http://x", num_prompts=4, request_rate=float("inf"), max_concurrency=c)
        results.append(r)
    plots = (plot_sweep(results, str(tmp_path / "sweep.png")), plot_requests(results[0], str(tmp_path / "one.png")))
    for path in plots:
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
