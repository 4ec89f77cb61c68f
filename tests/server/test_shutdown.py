"""Stopping a server: Ctrl-C (SIGINT) or SIGTERM ends the process, with the engine loop on the model thread.

Without --async-scheduling the engine loop runs on the engine's model thread, which is no daemon: the process
exits only once that loop has ended. The shared test server runs with --async-scheduling, so this starts its own.
"""

import signal

import pytest

from tests.server.utils import RemoteServer

ARGS = ["--max-model-len", "1024", "--kv-cache-memory-bytes", str(64 * 2**20), "--max-num-seqs", "4",
        "--served-model-name", "demo", "--uvicorn-log-level", "warning", "--disable-log-stats"]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_ends_the_server_after_its_running_stream(sig):
    server = RemoteServer(ARGS)
    try:
        with server.http() as http, http.stream("POST", "/v1/completions", json={
                "model": "demo", "prompt": "Once upon a time", "max_tokens": 32, "ignore_eos": True,
                "stream": True}) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            server.proc.send_signal(sig)  # the stream in flight still ends (uvicorn's graceful shutdown)
            rest = list(lines)
        assert [line for line in rest if line][-1] == "data: [DONE]"
        # After SIGINT serve() returns (its AsyncLLM.shutdown() ran) and the status is 0; uvicorn raises SIGTERM again
        # once it has stopped, and that signal's default action ends the process (-15).
        assert server.proc.wait(timeout=60) == (0 if sig == signal.SIGINT else -sig), server.read_log()[-4000:]
        assert "did not end cleanly" not in server.read_log()
    finally:
        server.stop()
