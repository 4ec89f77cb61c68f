"""vLLM's request extensions against the real server: truncate_prompt_tokens, best_of, prompt_logprobs, and
completions' echo + logprobs offsets (streamed and not)."""

import json

import pytest

from tests.server.test_errors import check_error
from tests.server.utils import MODEL, server  # noqa: F401

MAX_MODEL_LEN = 2048  # tests/server/utils.py's --max-model-len
LONG_PROMPT = "hello " * 3000  # over MAX_MODEL_LEN tokens


@pytest.fixture(scope="module")
def http(server):
    with server.http() as client:
        yield client


def _complete(http, **body) -> dict:
    r = http.post("/v1/completions", json={"model": MODEL, "max_tokens": 4, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def _stream_events(http, path: str, body: dict) -> list[dict]:
    r = http.post(path, json={**body, "stream": True})
    assert r.status_code == 200, r.text
    events = [e for e in r.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    return [json.loads(e.removeprefix("data: ")) for e in events[:-1]]


# -- truncate_prompt_tokens -----------------------------------------------------------------------------

def test_truncate_prompt_tokens_keeps_the_last_tokens_of_a_text_prompt(http):
    ids = http.post("/tokenize", json={"prompt": LONG_PROMPT + "the end"}).json()["tokens"]
    assert len(ids) > MAX_MODEL_LEN
    out = _complete(http, prompt=LONG_PROMPT + "the end", truncate_prompt_tokens=100)
    assert out["usage"]["prompt_tokens"] == 100
    # left truncation: the same greedy text as the last 100 ids sent as the prompt
    assert out["choices"][0]["text"] == _complete(http, prompt=ids[-100:])["choices"][0]["text"]


def test_truncate_prompt_tokens_on_token_ids_and_echo(http):
    ids = http.post("/tokenize", json={"prompt": "one two three four five six seven eight"}).json()["tokens"]
    out = _complete(http, prompt=ids, truncate_prompt_tokens=3, echo=True, max_tokens=2)
    assert out["usage"]["prompt_tokens"] == 3
    tail = http.post("/detokenize", json={"tokens": ids[-3:]}).json()["prompt"]
    assert out["choices"][0]["text"].startswith(tail)  # echo returns the prompt the model saw
    assert not out["choices"][0]["text"].startswith("one")


def test_truncate_prompt_tokens_longer_than_the_prompt_and_minus_one(http):
    plain = _complete(http, prompt="Hello there")
    for k in (500, -1):
        out = _complete(http, prompt="Hello there", truncate_prompt_tokens=k)
        assert out["usage"] == plain["usage"] and out["choices"][0]["text"] == plain["choices"][0]["text"]


def test_truncate_prompt_tokens_in_chat_applies_to_the_rendered_prompt(http):
    messages = [{"role": "user", "content": LONG_PROMPT}]
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 3,
                                                "truncate_prompt_tokens": 64})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 64
    events = _stream_events(http, "/v1/chat/completions", {
        "model": MODEL, "messages": messages, "max_tokens": 3, "truncate_prompt_tokens": 64,
        "stream_options": {"include_usage": True}})
    assert events[-1]["usage"]["prompt_tokens"] == 64


def test_truncate_prompt_tokens_is_a_known_field(http, server):
    _complete(http, prompt="x", truncate_prompt_tokens=5, max_tokens=1)
    assert "ignored: ['truncate_prompt_tokens']" not in server.read_log()


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "x"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
])
def test_truncate_prompt_tokens_bad_values(http, path, body):
    for k in (0, -2):
        check_error(http.post(path, json={**body, "truncate_prompt_tokens": k}), 400,
                    param="truncate_prompt_tokens", contains=("truncate_prompt_tokens must be >= 1", f"got {k}"))
    check_error(http.post(path, json={**body, "truncate_prompt_tokens": MAX_MODEL_LEN + 1}), 400,
                param="truncate_prompt_tokens", contains=(str(MAX_MODEL_LEN + 1), f"({MAX_MODEL_LEN})"))


# -- best_of, prompt_logprobs ---------------------------------------------------------------------------

def test_best_of_equal_to_n_is_accepted(http):
    assert len(_complete(http, prompt="x", best_of=1, max_tokens=1)["choices"]) == 1
    out = _complete(http, prompt="x", best_of=2, n=2, temperature=1.0, max_tokens=1)
    assert len(out["choices"]) == 2


@pytest.mark.parametrize("body", [{"best_of": 2}, {"best_of": 3, "n": 2, "temperature": 1.0}, {"best_of": 0}])
def test_best_of_other_than_n_is_refused(http, body):
    check_error(http.post("/v1/completions", json={"prompt": "x", **body}), 400, param="best_of",
                contains=("best_of is not supported", "use n"))


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "x"}),
    ("/v1/completions", {"prompt": "x", "echo": True, "logprobs": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
])
def test_prompt_logprobs_is_refused(http, path, body):
    for value in (0, 1, 5):
        check_error(http.post(path, json={**body, "prompt_logprobs": value}), 400, param="prompt_logprobs",
                    contains=("prompt_logprobs is not supported by this server",))
    r = http.post(path, json={**body, "prompt_logprobs": None, "max_tokens": 1})
    assert r.status_code == 200, r.text


# -- echo + logprobs: text_offset indexes the returned text, streamed or not ----------------------------

@pytest.mark.parametrize("prompt", ["Hello there, how are you", "tokens"])
def test_echo_logprobs_text_offset_same_streamed_or_not(http, prompt):
    body = {"model": MODEL, "prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 6, "temperature": 0}
    full = _complete(http, **body)["choices"][0]
    events = _stream_events(http, "/v1/completions", body)
    streamed_text = "".join(e["choices"][0]["text"] for e in events)
    streamed = [e["choices"][0]["logprobs"] for e in events if e["choices"][0]["logprobs"]]
    offsets = [o for lp in streamed for o in lp["text_offset"]]
    tokens = [t for lp in streamed for t in lp["tokens"]]
    assert streamed_text == full["text"] and tokens == full["logprobs"]["tokens"]
    assert offsets == full["logprobs"]["text_offset"]
    assert offsets[0] == len(prompt)  # the generated tokens follow the echoed prompt
    for offset, token in zip(offsets, tokens):
        assert full["text"][offset:offset + len(token)] == token
