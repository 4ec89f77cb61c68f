"""`ascendserve bench serve` as a subprocess against a real `ascendserve serve` on the demo model."""

import glob
import json
import os
import subprocess
import sys

import pytest

from tests.server.utils import RemoteServer

SERVER_ARGS = ["--max-model-len", "1024", "--kv-cache-memory-bytes", str(256 * 2**20),
               "--uvicorn-log-level", "warning", "--disable-log-stats", "--disable-log-requests"]


@pytest.fixture(scope="module")
def server():
    remote = RemoteServer(SERVER_ARGS)
    yield remote
    remote.stop()


def test_bench_serve_end_to_end(server, tmp_path):
    pytest.importorskip("matplotlib")
    cmd = [sys.executable, "-m", "ascendserve.cli.main", "bench", "serve", "--base-url", server.url,
           "--num-prompts", "4", "--random-input-len", "16", "--random-output-len", "8", "--max-concurrency", "2",
           "--ignore-eos", "--save-result", "--plot", "--result-dir", str(tmp_path), "--seed", "7"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr + server.read_log()[-3000:]
    lines = proc.stdout.splitlines()
    assert "============ Serving Benchmark Result ============" in lines
    for expected in ("Successful requests:                     4", "Failed requests:                         0",
                     "Maximum request concurrency:             2", "Total input tokens:                      64",
                     "Total generated tokens:                  32"):
        assert any(line.startswith(expected) for line in lines), expected
    for name in ("TTFT", "TPOT", "ITL", "E2EL"):
        assert any(line.startswith(f"P99 {name} (ms):") for line in lines), name

    [result_path] = glob.glob(str(tmp_path / "*.json"))
    result = json.loads(open(result_path).read())
    assert (result["completed"], result["failed"]) == (4, 0)
    assert (result["total_input_tokens"], result["total_output_tokens"]) == (64, 32)
    assert result["input_lens"] == [16] * 4 and result["output_lens"] == [8] * 4
    # The server counted the same prompt tokens the benchmark built (its own /tokenize).
    assert result["server_input_lens"] == [16] * 4
    assert all(len(itl) == 7 for itl in result["itls"])
    assert result["mean_ttft_ms"] > 0 and result["p99_e2el_ms"] >= result["median_e2el_ms"]
    png = os.path.splitext(result_path)[0] + ".png"
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_bench_serve_names_the_error_when_requests_fail(server):
    """Every request over the server's max_model_len: the report was all zeros and said nothing of why."""
    cmd = [sys.executable, "-m", "ascendserve.cli.main", "bench", "serve", "--base-url", server.url,
           "--num-prompts", "3", "--random-input-len", "16", "--random-output-len", "2000", "--disable-tqdm"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert any(line.startswith("Failed requests:                         3") for line in proc.stdout.splitlines())
    [line] = [line for line in proc.stderr.splitlines() if "requests failed" in line]
    assert line.startswith("ascendserve bench serve: 3 of 3 requests failed; the first error: HTTP 400")
    assert "max_tokens" in line or "1024" in line, line


def test_bench_serve_sends_its_sampling_flags(server):
    """--top-p / --top-k / --min-p / --repetition-penalty reach the requests (the server refuses a bad one)."""
    base = [sys.executable, "-m", "ascendserve.cli.main", "bench", "serve", "--base-url", server.url,
            "--num-prompts", "2", "--random-input-len", "16", "--random-output-len", "8", "--ignore-eos",
            "--disable-tqdm", "--temperature", "0.8", "--top-k", "5", "--min-p", "0.01", "--repetition-penalty", "1.1"]
    proc = subprocess.run(base + ["--top-p", "0.9"], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr + server.read_log()[-3000:]
    assert any(line.startswith("Total generated tokens:                  16") for line in proc.stdout.splitlines())
    proc = subprocess.run(base + ["--top-p", "1.5"], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 2, proc.stdout + proc.stderr  # the initial test request names it
    assert "the initial test request failed: HTTP 400" in proc.stderr and "'top_p'" in proc.stderr, proc.stderr
