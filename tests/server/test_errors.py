"""Bad input against the real server: OpenAI error bodies with the right status, naming the field, never a 500."""

import openai
import pytest

from tests.server.utils import MODEL, server  # noqa: F401

CHAT = [{"role": "user", "content": "Hi"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def check_error(response, status: int, *, param: str | None = None, contains: tuple[str, ...] = ()) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["type"].endswith("Error")
    if param is not None:
        assert error["param"] == param, error
    for text in contains:
        assert text in error["message"], error["message"]
    return error


@pytest.fixture(scope="module")
def http(server):
    with server.http() as client:
        yield client


@pytest.mark.parametrize("path, contains", [
    ("/v1/responses", "the Responses API is not implemented; use /v1/chat/completions"),
    ("/v1/embeddings", "pooling models (embeddings, classification, scores) are not implemented"),
    ("/v1/audio/transcriptions", "speech models are not implemented"),
    ("/v1/nothing", "Not Found"),  # a path vLLM does not serve either: plain
])
def test_vllms_other_endpoints_say_they_are_not_served(http, path, contains):
    check_error(http.post(path, json={"model": MODEL, "input": "hi"}), 404, contains=(contains,))


def test_invalid_json(http):
    r = http.post("/v1/chat/completions", content=b'{"messages": [', headers={"Content-Type": "application/json"})
    check_error(r, 400, contains=("Invalid JSON",))


@pytest.mark.parametrize("path, body, param, contains", [
    ("/v1/chat/completions", {}, "messages", ("messages", "required")),
    ("/v1/chat/completions", {"messages": "hi"}, "messages", ("messages",)),
    ("/v1/chat/completions", {"messages": CHAT, "temperature": -1}, "temperature", ("temperature",)),
    ("/v1/chat/completions", {"messages": CHAT, "top_p": 1.5}, "top_p", ("top_p",)),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 0}, "max_tokens", ("max_tokens",)),
    ("/v1/chat/completions", {"messages": CHAT, "n": 0}, "n", ("n",)),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 50, "logprobs": True}, "top_logprobs",
     ("top_logprobs", "--max-logprobs")),
    ("/v1/chat/completions", {"messages": CHAT, "presence_penalty": 3}, "presence_penalty", ()),
    ("/v1/chat/completions", {"messages": CHAT, "stream_options": {"include_usage": True}}, None,
     ("stream_options",)),
    ("/v1/completions", {"prompt": "x", "top_k": -5}, "top_k", ("top_k",)),
    ("/v1/completions", {"prompt": "x", "logprobs": 99}, "logprobs", ("logprobs",)),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [10**9]}, "stop_token_ids", ("stop_token_ids",)),
    ("/v1/completions", {"prompt": "x", "min_tokens": 9, "max_tokens": 2}, "min_tokens", ("min_tokens",)),
    ("/v1/completions", {"prompt": []}, "prompt", ("prompt",)),
    ("/v1/completions", {"prompt": [10**9]}, "prompt", ("prompt token ids",)),
    ("/v1/completions", {"prompt": "x", "n": 2, "temperature": 0}, "n", ("greedy",)),
    ("/v1/chat/completions", {"messages": CHAT, "bad_words": [3]}, "bad_words.0", ("valid string",)),
    # an n this large used to be accepted and build its children on the engine thread until memory ran out
    ("/v1/completions", {"prompt": "x", "n": 1208925819614629174706176, "temperature": 1.0}, "n",
     ("n must be at most 16384 (VLLM_MAX_N_SEQUENCES)",)),
    ("/v1/completions", {"prompt": "x", "priority": 5}, "priority", ("priority 5 needs priority scheduling",)),
])
def test_schema_and_range_errors(http, path, body, param, contains):
    check_error(http.post(path, json=body), 400, param=param, contains=contains)


def test_context_length_errors_say_both_numbers(http):
    long_prompt = "hello " * 1500
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": long_prompt, "max_tokens": 1000})
    error = check_error(r, 400, param="max_tokens", contains=("maximum context length is 2048 tokens", "1000 in the"))
    assert "in the prompt" in error["message"]
    r = http.post("/v1/chat/completions", json={"messages": CHAT, "max_completion_tokens": 5000})
    check_error(r, 400, param="max_completion_tokens", contains=("2048", "in the messages, 5000 in the completion"))
    r = http.post("/v1/completions", json={"prompt": "hello " * 3000})
    check_error(r, 400, param="prompt", contains=("maximum context length is 2048", "input tokens"))


def test_unknown_model_is_404(http, server):
    check_error(http.post("/v1/completions", json={"model": "gpt-4", "prompt": "x"}), 404, param="model",
                contains=("gpt-4",))
    with pytest.raises(openai.NotFoundError):
        server.client().chat.completions.create(model="nope", messages=CHAT)


def test_unknown_route_and_method(http):
    check_error(http.get("/v1/nothing"), 404)
    check_error(http.get("/v1/chat/completions"), 405)


def test_tool_choice_errors(http):
    r = http.post("/v1/chat/completions", json={"messages": CHAT, "tool_choice": "required"})
    check_error(r, 400, param="tool_choice", contains=("requires tools",))
    r = http.post("/v1/chat/completions", json={"messages": CHAT, "tools": TOOLS,
                                                "tool_choice": {"type": "function", "function": {"name": "x"}}})
    check_error(r, 400, param="tool_choice", contains=("'x'",))
    r = http.post("/v1/chat/completions", json={"messages": CHAT, "tools": TOOLS, "tool_choice": "sometimes"})
    check_error(r, 400, param="tool_choice")


def test_chat_content_and_template_errors(http):
    image = [{"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}]
    check_error(http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": image}]}), 400,
                param="messages[0].content[0]", contains=("the vision tower is not implemented",))
    big = [{"type": "text", "text": "hi"}, {"type": "image_jpeg", "data": "A" * 100_000}]  # an unknown inline part
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": big}]})
    check_error(r, 400, param="messages[0].content[1]", contains=("unknown type 'image_jpeg'",))
    assert len(r.text) < 1000  # the part is not echoed back
    r = http.post("/v1/chat/completions", json={"messages": CHAT, "chat_template": "{{ bad"})
    check_error(r, 400, param="chat_template", contains=("--trust-request-chat-template",))
    r = http.post("/v1/chat/completions", json={"messages": CHAT, "continue_final_message": True,
                                                "add_generation_prompt": False})
    check_error(r, 400, param="continue_final_message")


def test_detokenize_out_of_vocabulary(http):
    check_error(http.post("/detokenize", json={"tokens": [-1]}), 400, param="tokens")


def test_official_client_raises_bad_request(server):
    with pytest.raises(openai.BadRequestError) as info:
        server.client().completions.create(model=MODEL, prompt="x", temperature=5.5, max_tokens=10**6)
    assert info.value.status_code == 400


@pytest.mark.parametrize("body, param, contains", [
    ({}, "prompt", ("'prompt' is a required field",)),
    ({"messages": []}, "messages", ("'messages'", "at least 1 item")),
    ({"messages": None}, "messages", ("'messages'",)),
    ({"prompt": 5}, "prompt", ("'prompt'",)),
])
def test_tokenize_errors_name_the_field(http, body, param, contains):
    error = check_error(http.post("/tokenize", json=body), 400, param=param, contains=contains)
    assert "prompt.prompt" not in error["message"] and "Tokenize" not in error["message"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
@pytest.mark.parametrize("kwargs, got", [
    ({"content": b'{"prompt": "x"}', "headers": {"Content-Type": "text/plain"}}, "not application/json"),
    ({"content": b"prompt=x", "headers": {"Content-Type": "application/x-www-form-urlencoded"}},
     "not application/json"),
    ({}, "no body"),
    ({"json": ["x"]}, "an array"),
    ({"json": "x"}, "a string"),
])
def test_body_must_be_a_json_object(http, path, kwargs, got):
    error = check_error(http.post(path, **kwargs), 400,
                        contains=("request body must be a JSON object", "application/json", got))
    assert "valid dictionary" not in error["message"]
