"""vLLM's HTTP-layer flags on a real server: HTTPS (--ssl-*), --root-path, X-Request-Id, --middleware,
--disable-fastapi-docs, --enable-server-load-tracking, --enable-log-requests / --max-log-len; the listening socket
bound before the model loads (a taken port fails at once); --version and unknown flags."""

import argparse
import os
import logging
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time

import httpx
import pytest

from ascendserve.cli.main import main
from ascendserve import SamplingParams
from ascendserve.cli.serve import bind_socket
from ascendserve.entrypoints.openai.serving_engine import log_request
from tests.server.utils import API_KEY, MODEL, RemoteServer, free_port

MIDDLEWARE = "tests.server.frontend_middleware"


@pytest.fixture(scope="module")
def certificate(tmp_path_factory) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1: (key file, certificate file)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    out = tmp_path_factory.mktemp("tls")
    key, cert = str(out / "key.pem"), str(out / "cert.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return key, cert


@pytest.fixture(scope="module")
def server(certificate):
    key, cert = certificate
    s = RemoteServer(["--max-model-len", "1024", "--kv-cache-memory-bytes", str(64 * 2**20),
                      "--served-model-name", MODEL, "--api-key", API_KEY, "--ssl-keyfile", key, "--ssl-certfile", cert,
                      "--root-path", "/api", "--enable-request-id-headers", "--disable-fastapi-docs",
                      "--middleware", f"{MIDDLEWARE}.TagResponses", "--middleware", f"{MIDDLEWARE}.tag_function",
                      "--enable-server-load-tracking", "--enable-log-requests", "--max-log-len", "40",
                      "--uvicorn-log-level", "warning", "--disable-log-stats"])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def https(server, certificate):
    with httpx.Client(base_url=server.url, verify=ssl.create_default_context(cafile=certificate[1]),
                      headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as client:
        yield client


def test_https_with_the_given_certificate(server, https):
    assert server.url.startswith("https://") and https.get("/health").status_code == 200
    with pytest.raises(httpx.HTTPError):  # plain HTTP to the TLS port gets no answer
        httpx.get(f"http://127.0.0.1:{server.port}/health", timeout=5)


def test_request_ids_come_from_the_header(https):
    """vLLM's: the response id carries X-Request-Id, which --enable-request-id-headers echoes; two requests may
    share one (the engine's ids stay distinct)."""
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
    r = https.post("/v1/completions", json=body, headers={"X-Request-Id": "my-req-1"})
    assert r.status_code == 200 and r.json()["id"] == "cmpl-my-req-1" and r.headers["x-request-id"] == "my-req-1"
    r = https.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2,
                                                 "messages": [{"role": "user", "content": "Hi"}]},
                   headers={"X-Request-Id": "my-req-2"})
    assert r.status_code == 200 and r.json()["id"] == "chatcmpl-my-req-2"
    r = https.post("/v1/completions", json=body)
    assert re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"]) and r.json()["id"].startswith("cmpl-")
    results = []

    def send():
        results.append(https.post("/v1/completions", json={**body, "max_tokens": 8},
                                  headers={"X-Request-Id": "same"}))

    threads = [threading.Thread(target=send) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.status_code for r in results] == [200, 200]
    assert all(r.json()["id"] == "cmpl-same" and r.json()["usage"]["completion_tokens"] > 0 for r in results)


def test_middleware_docs_and_root_path(https):
    # --root-path (FastAPI's root_path, as vLLM sets it): the routes answer with the prefix (a proxy that passes it
    # on) and without it (a proxy that strips it); uvicorn's root_path used to put it in front of every path, so
    # /api/v1/models was a 404
    for path in ("/health", "/v1/models", "/api/health", "/api/v1/models"):
        r = https.get(path)
        assert r.status_code == 200 and r.headers["x-tag-class"] == "1" and r.headers["x-tag-function"] == "1", path
        assert r.headers["x-root-path"] == "/api"
    assert https.get("/apix/v1/models").status_code == 404  # a prefix of a path segment is no root path
    # the API key still guards /v1 under --root-path, with the prefix and without it
    for path in ("/v1/models", "/api/v1/models"):
        assert https.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401, path
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert https.get(path).status_code == 404, path


def test_server_load_counts_requests_in_flight(https):
    assert https.get("/load").json() == {"server_load": 0}
    seen = []
    with https.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": "Count", "max_tokens": 64,
                                                       "ignore_eos": True, "stream": True}) as r:
        for _ in r.iter_lines():
            if not seen:
                seen.append(https.get("/load").json()["server_load"])
    assert seen == [1]
    deadline = time.monotonic() + 30
    while https.get("/load").json()["server_load"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert https.get("/load").json() == {"server_load": 0}


def test_requests_are_logged_with_their_whole_parameters(server, https):
    """vLLM's RequestLogger: --max-log-len cuts the prompt (logged at debug level), never the parameters; they used
    to be cut to 40 characters here, which left "SamplingParams(n=1, " of every request."""
    https.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 2,
                                        "stop": ["a" * 100]}, headers={"X-Request-Id": "logged-1"})
    lines = [line for line in server.read_log().splitlines() if "Received request cmpl-logged-1-0" in line]
    assert len(lines) == 1 and "a" * 100 in lines[0] and "max_tokens=2" in lines[0], lines


def test_the_logged_prompt_is_cut_to_max_log_len(caplog):
    prompt = {"prompt": "x" * 100, "prompt_token_ids": list(range(100))}
    with caplog.at_level(logging.DEBUG, logger="ascendserve"):
        log_request("r-1", prompt, SamplingParams(max_tokens=3, stop=["y" * 50]), max_log_len=10)
    info, debug = [r.getMessage() for r in caplog.records if "r-1" in r.getMessage()]
    assert "100 prompt tokens" in info and "y" * 50 in info
    assert debug == f"Request r-1 prompt: {'x' * 10!r}, prompt_token_ids: {list(range(10))}"


def test_a_taken_port_fails_before_the_model_loads():
    """vLLM binds the socket first; this server used to load the model, log that it was serving, then fail."""
    port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        out = subprocess.run([sys.executable, "-m", "ascendserve.cli.main", "serve", "--host", "127.0.0.1",
                              "--port", str(port)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stderr[-2000:]
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in out.stderr
    assert "Engine ready" not in out.stderr + out.stdout


def test_unix_socket(tmp_path):
    path = str(tmp_path / "ascendserve.sock")
    uds = argparse.Namespace(uds=path, host="127.0.0.1", port=0)
    (tmp_path / "ascendserve.sock").write_text("")  # not a socket: left alone, bind fails
    with pytest.raises(OSError):
        bind_socket(uds)
    (tmp_path / "ascendserve.sock").unlink()
    sock = bind_socket(uds)
    try:
        with socket.socket(socket.AF_UNIX) as client:
            client.connect(path)
        # a second server on the socket of a live one fails as a taken port does; it used to remove the socket
        # file, and the first server could no longer be reached
        with pytest.raises(OSError, match="Address already in use"):
            bind_socket(uds)
        with socket.socket(socket.AF_UNIX) as client:
            client.connect(path)
    finally:
        sock.close()
    sock = bind_socket(uds)  # the file a stopped server left: nothing listens, so it is replaced
    sock.close()


@pytest.mark.parametrize("flags, message", [
    (["--ssl-keyfile", "k.pem"], "--ssl-keyfile and --ssl-certfile go together"),
    (["--middleware", "no_such_module.Thing"], "--middleware no_such_module.Thing: cannot import it"),
    (["--middleware", f"{MIDDLEWARE}.NOT_CALLABLE"], "an import path of an ASGI middleware class"),
    (["--max-log-len", "-1"], "--max-log-len must be >= 0"),
])
def test_bad_frontend_flags_stop_start_up(flags, message, capsys):
    assert main(["serve", *flags]) == 2
    assert message in capsys.readouterr().err


def test_version_and_unknown_flags(capsys):
    from ascendserve.version import __version__
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.strip() == __version__
    with pytest.raises(SystemExit) as info:
        main(["serve", "--no-such-flag"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "ascendserve serve: error: unrecognized arguments: --no-such-flag" in err


def test_a_server_on_a_unix_socket_answers_there_and_removes_it_at_exit(tmp_path):
    path = str(tmp_path / "serve.sock")
    log = open(tmp_path / "server.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "ascendserve.cli.main", "serve", "--uds", path,
                             "--max-model-len", "256", "--kv-cache-memory-bytes", str(32 * 2**20),
                             "--served-model-name", MODEL, "--disable-log-stats"], stdout=log, stderr=subprocess.STDOUT)
    try:
        with httpx.Client(transport=httpx.HTTPTransport(uds=path), base_url="http://localhost", timeout=120) as client:
            deadline = time.monotonic() + 300
            while proc.poll() is None and time.monotonic() < deadline:
                try:
                    if client.get("/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.5)
            r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 2})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        proc.terminate()  # uvicorn raises SIGTERM again once it has stopped: its default action ends the process
        assert proc.wait(timeout=60) == -signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.seek(0)
        output = log.read()
        log.close()
    assert not os.path.exists(path), output[-2000:]
