"""The ways a vLLM user starts a server: `python -m ascendserve ...` and vLLM's older
`python -m vllm.entrypoints.openai.api_server --model M ...`, here `python -m ascendserve.entrypoints.openai.api_server`."""

import subprocess
import sys

from ascendserve.version import __version__
from tests.server.utils import RemoteServer

API_SERVER = "ascendserve.entrypoints.openai.api_server"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=180)


def test_python_dash_m_ascendserve_is_the_command():
    proc = run("ascendserve", "--version")
    assert proc.returncode == 0 and proc.stdout.strip() == __version__, proc.stderr
    proc = run("ascendserve", "serve", "--max_model_len", "nope")
    assert proc.returncode == 2 and "argument --max-model-len" in proc.stderr, proc.stderr


def test_the_api_server_module_takes_serves_flags(tmp_path):
    proc = run(API_SERVER, "--model", str(tmp_path), "--port", "0")  # an empty directory: no model there
    assert proc.returncode == 2, proc.stderr
    assert "ascendserve serve: error:" in proc.stderr and str(tmp_path) in proc.stderr, proc.stderr
    proc = run(API_SERVER, "--help")
    assert proc.returncode == 0 and "--served-model-name" in proc.stdout and "--config" in proc.stdout


def test_the_api_server_module_serves_the_demo():
    """The real server started as vLLM's older entry point, answering the official client."""
    server = RemoteServer(["--max-model-len", "512", "--kv-cache-memory-bytes", str(64 * 2**20), "--max-num-seqs", "2",
                           "--served-model-name", "demo", "--disable-log-stats", "--uvicorn-log-level", "warning"],
                          entry=(API_SERVER,))
    try:
        client = server.client()
        assert [m.id for m in client.models.list().data] == ["demo"]
        out = client.completions.create(model="demo", prompt="The capital of France is", max_tokens=4, temperature=0)
        assert out.usage.completion_tokens == 4 and out.choices[0].text
    finally:
        server.stop()
