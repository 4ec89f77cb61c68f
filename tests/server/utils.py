"""Fixtures for the server tests: a real `ascendserve serve` subprocess on a free port, shared by modules.

Start-up loads the demo model (~25 s, more on a busy machine), so one server serves every test module
of a pytest run: `shared_server()` starts it once and stops it at exit. Import the `server` fixture
into a test module (`from tests.server.utils import server  # noqa: F401`).
"""

import atexit
import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import pytest

API_KEY = "sk-ascendserve-test"
# The flags of users' Qwen3.5 command lines that matter here, on the demo model, kept small to start fast.
SERVER_ARGS = [
    "--max-model-len", "2048", "--kv-cache-memory-bytes", str(256 * 2**20), "--max-num-seqs", "4",
    "--max-waiting-requests", "3", "--api-key", API_KEY, "--served-model-name", "demo", "demo-alias",
    "--reasoning-parser", "qwen3", "--tool-call-parser", "qwen3_coder", "--enable-auto-tool-choice",
    "--compilation-config", '{"cudagraph_mode":"FULL_DECODE_ONLY"}', "--async-scheduling",
    "--tensor-parallel-size", "1", "--uvicorn-log-level", "warning", "--disable-log-stats",
]
MODEL = "demo"
START_TIMEOUT_S = 300


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RemoteServer:
    """`python -m ascendserve.cli.main serve ...` (or another `entry`) in a subprocess, its output in a log file."""

    def __init__(self, args: list[str], env: dict | None = None,
                 entry: tuple[str, ...] = ("ascendserve.cli.main", "serve")) -> None:
        self.port = free_port()
        self.scheme = "https" if "--ssl-certfile" in args else "http"  # a test's self-signed certificate
        self.log = tempfile.NamedTemporaryFile("w+", prefix="ascendserve-server-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", *entry, "--host", "127.0.0.1", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})
        self._wait_ready()

    @property
    def url(self) -> str:
        """http://127.0.0.1:PORT (https with --ssl-certfile)"""
        return f"{self.scheme}://127.0.0.1:{self.port}"

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} ({self.log.name}):\n"
                                   f"{self.read_log()[-4000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1, verify=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop(keep_log=True)
        raise TimeoutError(f"server not ready after {START_TIMEOUT_S} s ({self.log.name}):\n{self.read_log()[-4000:]}")

    def read_log(self) -> str:
        """Everything the server printed so far."""
        with open(self.log.name, encoding="utf-8", errors="replace") as f:
            return f.read()

    def client(self, **kwargs):
        """The official sync OpenAI client, with the API key."""
        import openai
        return openai.OpenAI(base_url=self.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120, **kwargs)

    def async_client(self, **kwargs):
        """The official async OpenAI client, with the API key."""
        import openai
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120, **kwargs)

    def http(self, auth: bool = True) -> httpx.Client:
        """A plain httpx client (with the key unless auth=False)."""
        headers = {"Authorization": f"Bearer {API_KEY}"} if auth else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=120, verify=False)

    def metrics(self) -> dict[str, float]:
        """`/metrics` as {sample line name with labels: value} for the vllm:* samples."""
        text = httpx.get(self.url + "/metrics", timeout=30).text
        out = {}
        for line in text.splitlines():
            if line.startswith("vllm:"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def metric(self, name: str, **labels) -> float:
        """One sample, by name and labels other than model_name (0.0 when absent)."""
        for key, value in self.metrics().items():
            base = key.split("{", 1)[0]
            if base == name and all(f'{k}="{v}"' in key for k, v in labels.items()):
                return value
        return 0.0

    def stop(self, keep_log: bool = False) -> None:
        """Terminate (then kill) the process; remove its log file unless keep_log (a server that failed to start
        keeps it: the error names it)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        if not keep_log and os.path.exists(self.log.name):
            os.unlink(self.log.name)


_shared: RemoteServer | None = None


def shared_server() -> RemoteServer:
    """The one demo server of this pytest process (started on first use, stopped at exit)."""
    global _shared
    if _shared is None or _shared.proc.poll() is not None:
        _shared = RemoteServer(SERVER_ARGS)
        atexit.register(_shared.stop)
    return _shared


@pytest.fixture(scope="module")
def server() -> RemoteServer:
    """The shared demo server."""
    return shared_server()


def wait_until_idle(server: RemoteServer, idle_kv_usage: float = 0.0, timeout_s: float = 60) -> dict:
    """Poll /metrics until no request runs or waits and the KV usage is back to idle; return the metrics."""
    deadline = time.monotonic() + timeout_s
    while True:
        running = server.metric("vllm:num_requests_running")
        waiting = server.metric("vllm:num_requests_waiting")
        usage = server.metric("vllm:kv_cache_usage_perc")
        if running == 0 and waiting == 0 and usage <= idle_kv_usage:
            return server.metrics()
        if time.monotonic() > deadline:
            raise AssertionError(f"not idle after {timeout_s} s: running={running} waiting={waiting} "
                                 f"kv_cache_usage_perc={usage}")
        time.sleep(0.25)
