"""vLLM's request extensions against the real server: truncate_prompt_tokens, best_of, prompt_logprobs (and
completions' echo + logprobs, which returns the prompt's), and echo + logprobs offsets (streamed and not)."""

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


PROMPT = "The quick brown fox jumps over the lazy dog"


def _prompt_ids(http, prompt: str = PROMPT) -> list[int]:
    return http.post("/tokenize", json={"prompt": prompt}).json()["tokens"]


def test_echo_with_logprobs_returns_the_prompt_tokens_logprobs(http):
    """lm-eval's loglikelihood request (echo, logprobs 1, max_tokens 1, a list of prompts): the logprobs lists start
    with every prompt token, the first with null logprobs; each choice also carries vLLM's prompt_logprobs."""
    out = _complete(http, prompt=[PROMPT, "tokens"], echo=True, logprobs=1, max_tokens=1)
    for choice, prompt in zip(out["choices"], [PROMPT, "tokens"]):
        ids = _prompt_ids(http, prompt)
        lp, entries = choice["logprobs"], choice["prompt_logprobs"]
        assert len(lp["tokens"]) == len(ids) + 1 and len(entries) == len(ids) and entries[0] is None
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None and lp["text_offset"][0] == 0
        assert "".join(lp["tokens"][:len(ids)]) == prompt
        for j in range(1, len(ids)):
            entry = entries[j][str(ids[j])]
            assert lp["token_logprobs"][j] == pytest.approx(entry["logprob"]) and entry["logprob"] <= 0
            assert entry["decoded_token"] == lp["tokens"][j] and entry["rank"] >= 1
            assert len(entries[j]) <= 2 and len(lp["top_logprobs"][j]) <= 2


def test_prompt_logprobs_equal_the_logprob_of_generating_that_token(http):
    """Prompt token j's logprob is the one the model gives it after tokens 0..j-1: generating from that prefix with
    only that token allowed samples it with the same (raw) logprob."""
    ids = _prompt_ids(http)
    entries = _complete(http, prompt=ids, prompt_logprobs=0, max_tokens=1)["choices"][0]["prompt_logprobs"]
    assert all(list(entries[j]) == [str(ids[j])] for j in range(1, len(ids)))
    for j in (1, len(ids) // 2, len(ids) - 1):
        step = _complete(http, prompt=ids[:j], max_tokens=1, logprobs=0, allowed_token_ids=[ids[j]])["choices"][0]
        assert step["logprobs"]["token_logprobs"][0] == pytest.approx(entries[j][str(ids[j])]["logprob"], abs=2e-3)


def test_bad_words(http):
    """vLLM's bad_words: the greedy first token, banned, is not generated (it used to be a 400)."""
    base = _complete(http, prompt="The capital of France is", logprobs=0, max_tokens=3)["choices"][0]
    first = base["logprobs"]["tokens"][0]
    out = _complete(http, prompt="The capital of France is", logprobs=0, max_tokens=3, bad_words=[first])
    assert out["choices"][0]["logprobs"]["tokens"][0] != first, (first, out["choices"][0]["text"])


def test_beam_search(http):
    """vLLM's use_beam_search: n beams, best first (ranked by their summed logprobs, all of one length here); each
    beam's logprobs are the model's for its tokens (scored again through prompt_logprobs); chat and streaming too."""
    prompt = "The best way to learn a language is"
    out = _complete(http, prompt=prompt, use_beam_search=True, n=3, max_tokens=5, logprobs=0, ignore_eos=True)
    choices = out["choices"]
    assert len(choices) == 3 and len({c["text"] for c in choices}) == 3
    sums = [sum(c["logprobs"]["token_logprobs"]) for c in choices]
    assert sums == sorted(sums, reverse=True), sums
    prompt_ids, rescored_beams = _prompt_ids(http, prompt), 0
    for choice, total in zip(choices, sums):
        ids = _prompt_ids(http, prompt + choice["text"])
        if ids[:len(prompt_ids)] != prompt_ids or len(ids) != len(prompt_ids) + 5:
            continue  # the text does not tokenize back into the beam's tokens
        entries = _complete(http, prompt=ids, prompt_logprobs=0, max_tokens=1)["choices"][0]["prompt_logprobs"]
        rescored = sum(entries[j][str(ids[j])]["logprob"] for j in range(len(prompt_ids), len(ids)))
        assert rescored == pytest.approx(total, abs=1e-2)
        rescored_beams += 1
    assert rescored_beams
    streamed = _stream_events(http, "/v1/completions", {"model": MODEL, "prompt": prompt, "use_beam_search": True,
                                                        "n": 3, "max_tokens": 5, "ignore_eos": True})
    texts = {}
    for event in streamed:
        for c in event["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert [texts[i] for i in range(3)] == [c["text"] for c in choices]
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                                "use_beam_search": True, "n": 2, "max_tokens": 4})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text
    check_error(http.post("/v1/completions", json={"prompt": "x", "use_beam_search": True, "n": 11}), 400,
                param="n", contains=("2 x 11 = 22 logprobs", "--max-logprobs"))
    # the beam width is capped as n is (it skipped the cap: the search's steps run with n=1)
    check_error(http.post("/v1/completions", json={"prompt": "x", "use_beam_search": True, "n": 16385}), 400,
                param="n", contains=("16385 beams", "at most 16384 are allowed (VLLM_MAX_N_SEQUENCES)"))
    # echo + logprobs and prompt_logprobs carry the prompt's logprobs with beam search too (they were all null)
    echoed = _complete(http, prompt=prompt, use_beam_search=True, n=2, max_tokens=2, echo=True, logprobs=1,
                       prompt_logprobs=1)["choices"][0]
    plain = _complete(http, prompt=prompt, max_tokens=1, echo=True, logprobs=1)["choices"][0]
    head = len(prompt_ids)
    assert echoed["logprobs"]["token_logprobs"][:head] == plain["logprobs"]["token_logprobs"][:head]
    assert echoed["logprobs"]["token_logprobs"][0] is None and None not in echoed["logprobs"]["token_logprobs"][1:]
    assert len(echoed["prompt_logprobs"]) == head


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.mark.parametrize("path, body, constraint", [
    ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
     "tool_choice"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/completions", {"structured_outputs": {"regex": "[0-9]+"}}, "structured_outputs"),
])
def test_beam_search_refuses_a_grammar(http, path, body, constraint):
    """The search's steps cannot follow a grammar: a forced tool call under beam search used to come back as a
    successful call with arguments off the schema ("1"), a JSON response_format as any text."""
    base = {"messages": [{"role": "user", "content": "Weather in Paris?"}]} if "chat" in path else {"prompt": "x"}
    check_error(http.post(path, json={"model": MODEL, **base, **body, "use_beam_search": True, "n": 2,
                                      "max_tokens": 8}), 400, param="use_beam_search",
                contains=("beam search does not follow a grammar", f"({constraint})"))


def test_logprobs_minus_one_is_the_whole_vocabulary_up_to_the_cap(http):
    """vLLM's -1 for logprobs / top_logprobs (the whole vocabulary) reaches the --max-logprobs check; it used to be
    refused by the request's schema (">= 0") even on a server without a cap."""
    for path, body, name in (("/v1/completions", {"prompt": "x", "logprobs": -1}, "logprobs"),
                             ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                       "logprobs": True, "top_logprobs": -1}, "top_logprobs")):
        check_error(http.post(path, json={"model": MODEL, **body}), 400, param=name,
                    contains=("requested -1 (the whole vocabulary) logprobs per token", "at most 20 (--max-logprobs)"))
    check_error(http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "logprobs": -2}), 400,
                param="logprobs")


def test_completions_default_to_16_tokens(http):
    """OpenAI's and vLLM's completions default: max_tokens 16 (it used to be the rest of the context)."""
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Once upon a time", "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 16 and r.json()["choices"][0]["finish_reason"] == "length"


def test_echo_without_generation(http):
    """OpenAI's echo with max_tokens 0: the prompt and its logprobs come back, nothing generated (vLLM's); the
    official client sends it too."""
    ids = _prompt_ids(http)
    choice = _complete(http, prompt=PROMPT, echo=True, logprobs=0, max_tokens=0)["choices"][0]
    assert choice["text"] == PROMPT and len(choice["logprobs"]["tokens"]) == len(ids)
    assert all(v is not None for v in choice["logprobs"]["token_logprobs"][1:])
    # the token run and dropped is not counted (usage said 1 completion token)
    usage = _complete(http, prompt=PROMPT, echo=True, logprobs=0, max_tokens=0)["usage"]
    assert usage["completion_tokens"] == 0 and usage["total_tokens"] == usage["prompt_tokens"] == len(ids)
    events = _stream_events(http, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "echo": True, "max_tokens": 0,
                                                      "stream_options": {"include_usage": True}})
    assert events[-1]["usage"]["completion_tokens"] == 0
    check_error(http.post("/v1/completions", json={"prompt": "x", "max_tokens": 0}), 400, param="max_tokens",
                contains=("max_tokens must be at least 1", "only allowed with echo"))


def test_echo_without_generation_through_the_openai_client(server):
    client = server.client()
    out = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=1, max_tokens=0)
    assert out.choices[0].text == PROMPT and out.choices[0].logprobs.token_logprobs[0] is None


def test_prompt_logprobs_in_chat_and_completions(http):
    """vLLM's prompt_logprobs extension: per prompt token {id: {logprob, rank, decoded_token}}, the top k and the
    token itself; completions put it on each choice, chat on the response."""
    out = _complete(http, prompt=PROMPT, prompt_logprobs=2, max_tokens=2, n=2, temperature=1.0)
    assert out["choices"][0]["logprobs"] is None
    for choice in out["choices"]:
        entries = choice["prompt_logprobs"]
        assert entries[0] is None and len(entries) == out["usage"]["prompt_tokens"]
        assert all(2 <= len(e) <= 3 and {"logprob", "rank", "decoded_token"} == set(next(iter(e.values())))
                   for e in entries[1:])
        assert all(sorted(v["rank"] for v in e.values())[:2] == [1, 2] for e in entries[1:])
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                                "prompt_logprobs": 1, "max_tokens": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["prompt_logprobs"]) == body["usage"]["prompt_tokens"] and body["prompt_logprobs"][0] is None


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "x"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
])
def test_prompt_logprobs_limits(http, path, body):
    for value in (1, -1):  # vLLM's rule: a stream carries none (echo's own are streamed)
        check_error(http.post(path, json={**body, "prompt_logprobs": value, "stream": True}), 400,
                    param="prompt_logprobs", contains=("prompt_logprobs are not available when stream is true",))
    check_error(http.post(path, json={**body, "prompt_logprobs": 21}), 400, param="prompt_logprobs",
                contains=("requested 21 logprobs per token", "at most 20 (--max-logprobs)"))
    check_error(http.post(path, json={**body, "prompt_logprobs": -2}), 400, param="prompt_logprobs",
                contains=("prompt_logprobs must be non-negative or -1",))
    assert http.post(path, json={**body, "prompt_logprobs": 0, "stream": True, "max_tokens": 1}).status_code == 200


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
    prompt_len = len(_prompt_ids(http, prompt))  # the prompt's tokens come first, then the generated ones
    assert offsets[0] == 0 and offsets[prompt_len] == len(prompt)
    assert [e["choices"][0]["logprobs"]["token_logprobs"][0] for e in events[:1]] == [None]
    for offset, token in zip(offsets, tokens):
        assert full["text"][offset:offset + len(token)] == token
