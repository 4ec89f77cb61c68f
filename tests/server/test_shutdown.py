"""Stopping a server: Ctrl-C (SIGINT) or SIGTERM ends the process, with the engine loop on the model thread; requests
in flight are aborted at once, or drain for --shutdown-timeout seconds first.

Without --async-scheduling the engine loop runs on the engine's model thread, which is no daemon: the process
exits only once that loop has ended. The shared test server runs with --async-scheduling, so this starts its own.
"""

import json
import signal
import threading
import time

import pytest

from tests.server.utils import RemoteServer

ARGS = ["--max-model-len", "1024", "--kv-cache-memory-bytes", str(64 * 2**20), "--max-num-seqs", "4",
        "--served-model-name", "demo", "--uvicorn-log-level", "warning", "--disable-log-stats"]


def stream_then_signal(server: RemoteServer, sig, max_tokens: int) -> list[dict]:
    """Start a stream, signal the server once its first chunk is in, and read the stream to its end."""
    with server.http() as http, http.stream("POST", "/v1/completions", json={
            "model": "demo", "prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True}) as response:
        lines = response.iter_lines()
        first = next(lines)
        assert first.startswith("data: ")
        server.proc.send_signal(sig)
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    return [json.loads(line[len("data: "):]) for line in [first, *rest[:-1]]]


def assert_exits_cleanly(server: RemoteServer, sig) -> None:
    # After SIGINT serve() returns (its AsyncLLM.shutdown() ran) and the status is 0; uvicorn raises SIGTERM again
    # once it has stopped, and that signal's default action ends the process (-15).
    assert server.proc.wait(timeout=60) == (0 if sig == signal.SIGINT else -sig), server.read_log()[-4000:]
    assert "did not end cleanly" not in server.read_log() and "Traceback" not in server.read_log()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_aborts_the_requests_in_flight_and_ends_the_server(sig):
    """vLLM's default --shutdown-timeout 0: a stream in flight ends at once with finish_reason 'abort' and [DONE]
    (it used to run to its last token: with long generations the process did not exit for minutes)."""
    server = RemoteServer(ARGS)
    beam = {}

    def beam_search():  # a beam search in flight too: its steps are aborted, and its beams so far come back
        with server.http() as http:
            beam["response"] = http.post("/v1/completions", json={
                "model": "demo", "prompt": "Once upon a time", "max_tokens": 500, "ignore_eos": True,
                "use_beam_search": True, "n": 3})

    try:
        searcher = threading.Thread(target=beam_search)
        searcher.start()
        time.sleep(2)
        chunks = stream_then_signal(server, sig, max_tokens=1000)
        assert chunks[-1]["choices"][0]["finish_reason"] == "abort"
        assert sum(len(c["choices"][0]["text"]) > 0 for c in chunks) < 1000
        searcher.join(timeout=60)
        response = beam["response"]  # it used to be a 500 (IndexError), or no answer at all
        assert response.status_code == 200, response.text
        assert [c["finish_reason"] for c in response.json()["choices"]] == ["abort"] * 3
        assert_exits_cleanly(server, sig)
    finally:
        server.stop()


def test_shutdown_timeout_lets_requests_in_flight_finish():
    server = RemoteServer(ARGS + ["--shutdown-timeout", "120"])
    try:
        chunks = stream_then_signal(server, signal.SIGTERM, max_tokens=24)
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert "".join(c["choices"][0]["text"] for c in chunks)
        assert_exits_cleanly(server, signal.SIGTERM)
    finally:
        server.stop()
