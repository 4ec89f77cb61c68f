"""The OpenAI-compatible server, end to end: a real `ascendserve serve` subprocess, official clients."""

import asyncio
import json
import time

import httpx
import openai
import pytest

from tests.server.utils import API_KEY, MODEL, server, wait_until_idle  # noqa: F401

CHAT = [{"role": "user", "content": "Name three colors."}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def sse_events(response: httpx.Response) -> list:
    """The JSON events of an SSE response, checking the framing and the final [DONE]."""
    events = [line for line in response.text.split("\n\n") if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)
    return [json.loads(e[len("data: "):]) for e in events[:-1]]


# -- plain endpoints ----------------------------------------------------------------------------------

def test_health_version_models(server):
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").json()["version"]
    models = server.client().models.list()
    assert [m.id for m in models.data] == ["demo", "demo-alias"]
    card = server.client().models.retrieve("demo-alias")  # GET /v1/models/{model}: was a 404 for every name
    assert (card.id, card.owned_by, card.root, card.max_model_len) == (
        "demo-alias", models.data[1].owned_by, models.data[1].root, models.data[1].max_model_len)
    with pytest.raises(openai.NotFoundError, match="The model `nope` does not exist"):
        server.client().models.retrieve("nope")
    assert httpx.get(server.url + "/ping").status_code == httpx.post(server.url + "/ping").status_code == 200


def test_api_key_required_on_v1_only(server):
    with server.http(auth=False) as http:
        for method, path in [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions")]:
            r = http.request(method, path, json={"prompt": "x", "max_tokens": 1})
            assert r.status_code == 401, path
            assert r.json()["error"]["code"] == 401
        for header in ("Bearer wrong", f"Basic {API_KEY}", "Bearer", f"Bearer{API_KEY}", ""):
            r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers={"Authorization": header})
            assert r.status_code == 401, header
        r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1},
                      headers={"Authorization": f"bearer {API_KEY}"})  # the scheme is case-insensitive
        assert r.status_code == 200, r.text
        assert http.get("/health").status_code == 200
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_tokenize_detokenize_roundtrip(server):
    with server.http() as http:
        tok = http.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
        assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] == 2048
        assert len(tok["token_strs"]) == tok["count"]
        assert http.post("/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"] == "Hello world"
        chat = http.post("/tokenize", json={"messages": CHAT}).json()
        completion = server.client().chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1)
        assert chat["count"] == completion.usage.prompt_tokens
        # each body is checked against its own model: no field of it is reported as ignored
        assert "ignored: ['prompt']" not in server.read_log() and "ignored: ['messages']" not in server.read_log()
        missing = http.post("/tokenize", json={"text": "Hello"})
        assert missing.status_code == 400 and "prompt" in missing.text


# -- completions and chat -----------------------------------------------------------------------------

def test_completion_stream_equals_non_stream(server):
    client = server.client()
    kwargs = dict(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    full = client.completions.create(**kwargs)
    assert full.usage.completion_tokens == 8 and full.usage.prompt_tokens > 0
    assert full.usage.total_tokens == full.usage.prompt_tokens + 8
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 8 and not chunks[-1].choices


def test_chat_stream_equals_non_stream(server):
    client = server.client()
    full = client.chat.completions.create(model="demo-alias", messages=CHAT, max_tokens=8, temperature=0)
    assert full.model == "demo-alias" and full.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_stream_sse_framing(server):
    with server.http() as http:
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 3, "stream": True})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
        assert all(e["object"] == "chat.completion.chunk" for e in events)
        assert events[-1]["choices"][0]["finish_reason"] in ("length", "stop")


def test_n_and_seed(server):
    client = server.client()
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=1.0, seed=1234, n=2)
    first = client.completions.create(**kwargs)
    second = client.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert first.usage.completion_tokens == 12
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, n=2, temperature=0.9, seed=7)
    assert len(chat.choices) == 2


def test_stream_n_sends_each_choice_finish_once(server):
    """With n > 1 the choices finish at different steps; each sends its finish_reason in one chunk, and a finished
    choice sends nothing more while its siblings go on (it did once a step until all were done)."""
    client = server.client()
    prompt = "Q: Is the sky blue? Answer yes or no.\nA:"
    kwargs = dict(model=MODEL, max_tokens=12, n=3, temperature=1.0, seed=0, stop=["\n"])
    cases = [(client.completions, dict(prompt=prompt), lambda choice: choice.text),
             (client.chat.completions, dict(messages=[{"role": "user", "content": prompt}]),
              lambda choice: choice.delta.content if hasattr(choice, "delta") else choice.message.content)]
    for api, body, text_of in cases:
        full = api.create(**kwargs, **body)
        lengths = {len(text_of(c) or "") for c in full.choices}
        assert len(lengths) > 1, "the choices should finish at different steps for this test to mean anything"
        finishes = {i: [] for i in range(3)}
        texts = {i: "" for i in range(3)}
        for chunk in api.create(**kwargs, **body, stream=True):
            for choice in chunk.choices:
                texts[choice.index] += text_of(choice) or ""
                if choice.finish_reason is not None:
                    assert not finishes[choice.index], f"choice {choice.index} sent a chunk after its finish"
                    finishes[choice.index].append(choice.finish_reason)
        assert [finishes[c.index] for c in full.choices] == [[c.finish_reason] for c in full.choices]
        assert [texts[c.index] for c in full.choices] == [text_of(c) or "" for c in full.choices]


def test_chat_tool_turn_with_null_content_and_vllm_content_parts(server):
    """An assistant turn that only calls tools (`content: null`, or no content) renders as content "", as vLLM does;
    content lists take bare strings and `input_text` parts. Each prompt is the one spelled with plain strings."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}

    def turns(assistant: dict, user_content) -> list:
        return [{"role": "user", "content": user_content}, {"role": "assistant", **assistant, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]

    plain = turns({"content": ""}, "Weather in Paris?\nPlease.")
    with server.http() as http:
        expected = http.post("/tokenize", json={"messages": plain, "tools": TOOLS}).json()["tokens"]
        for assistant, user_content in [({"content": None}, "Weather in Paris?\nPlease."),
                                        ({}, ["Weather in Paris?", {"type": "input_text", "text": "Please."}])]:
            messages = turns(assistant, user_content)
            tokens = http.post("/tokenize", json={"messages": messages, "tools": TOOLS})
            assert tokens.status_code == 200, tokens.text
            assert tokens.json()["tokens"] == expected
    out = server.client().chat.completions.create(model=MODEL, messages=turns({"content": None}, "Weather?"),
                                                  tools=TOOLS, max_tokens=2)
    assert out.choices[0].finish_reason in ("length", "stop", "tool_calls")


def test_stop_string(server):
    client = server.client()
    greedy = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=10, temperature=0)
    text = greedy.choices[0].text
    stop = text.strip()[:2] if text.strip() else ","
    out = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=10, temperature=0, stop=[stop])
    assert out.choices[0].finish_reason == "stop"
    assert stop not in out.choices[0].text and text.startswith(out.choices[0].text)


def test_logprobs(server):
    client = server.client()
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0,
                                          logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
        assert entry.token == entry.top_logprobs[0].token  # greedy: the sampled token is the best one
    assert "".join(e.token for e in content) == chat.choices[0].message.content
    comp = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0, logprobs=2)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert lp.text_offset[0] == 0 and all(len(t) >= 2 for t in lp.top_logprobs)


def test_async_client_concurrent_requests(server):
    async def run():
        client = server.async_client()
        prompts = ["Red", "Green", "Blue"]
        outs = await asyncio.gather(*[client.completions.create(model=MODEL, prompt=p, max_tokens=5, temperature=0)
                                      for p in prompts])
        singles = [await client.completions.create(model=MODEL, prompt=p, max_tokens=5, temperature=0)
                   for p in prompts[:1]]
        stream = await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, stream=True)
        chunks = [c async for c in stream]
        await client.close()
        return outs, singles, chunks
    outs, singles, chunks = asyncio.run(run())
    assert all(o.usage.completion_tokens == 5 for o in outs)
    assert outs[0].choices[0].text == singles[0].choices[0].text  # batching does not change greedy text
    assert chunks[-1].choices[0].finish_reason is not None


def test_echo_and_prompt_token_ids(server):
    client = server.client()
    out = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=2, temperature=0, echo=True)
    assert out.choices[0].text.startswith("Hello there")
    with server.http() as http:
        ids = http.post("/tokenize", json={"prompt": "Hello there"}).json()["tokens"]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0)
    assert out.choices[0].text == "Hello there" + by_ids.choices[0].text


def test_multiple_prompts(server):
    out = server.client().completions.create(model=MODEL, prompt=["A", "B"], max_tokens=2, temperature=0)
    assert [c.index for c in out.choices] == [0, 1] and out.usage.completion_tokens == 4


# -- tools and parsers (the demo model does not emit Qwen tags; check the wiring and the guarantees) ---

def test_named_tool_choice_always_returns_that_call(server):
    client = server.client()
    choice = {"type": "function", "function": {"name": "get_weather"}}
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                         tools=TOOLS, tool_choice=choice, max_tokens=12, temperature=0)
    calls = out.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "get_weather"
    assert isinstance(json.loads(calls[0].function.arguments), dict)
    assert out.choices[0].message.content is None
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Paris?"}],
                                                 tools=TOOLS, tool_choice="required", max_tokens=12,
                                                 temperature=0, stream=True))
    deltas = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].index == 0 and deltas[0].function.name == "get_weather" and deltas[0].id.startswith("call_")
    arguments: dict[int, str] = {}
    for d in deltas:  # the model may add more calls after the forced one; each must be well-formed
        arguments[d.index] = arguments.get(d.index, "") + (d.function.arguments or "")
        assert d.function.name in (None, "get_weather")
    assert all(isinstance(json.loads(a), dict) for a in arguments.values())
    assert chunks[-1].choices[0].finish_reason in ("tool_calls", "length")
    assert not "".join(c.choices[0].delta.content or "" for c in chunks)


def test_auto_tool_choice_answers(server):
    out = server.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                  tools=TOOLS, max_tokens=5, temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert (choice.finish_reason == "tool_calls") == bool(choice.message.tool_calls)


# -- metrics, disconnects, overload --------------------------------------------------------------------

def test_metrics_present_and_moving(server):
    before = server.metrics()
    names = {k.split("{")[0] for k in before}
    for name in ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
                 "vllm:num_preemptions_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
                 "vllm:e2e_request_latency_seconds_count", "vllm:request_queue_time_seconds_count",
                 "vllm:request_prompt_tokens_count", "vllm:request_generation_tokens_count",
                 "vllm:request_prefill_time_seconds_count", "vllm:request_decode_time_seconds_count",
                 "vllm:request_inference_time_seconds_count", "vllm:request_time_per_output_token_seconds_count",
                 "vllm:time_per_output_token_seconds_count", "vllm:request_max_num_generation_tokens_count",
                 "vllm:request_params_n_count", "vllm:request_params_max_tokens_count",
                 "vllm:iteration_tokens_total_count"]:
        assert name in names, name
    # vllm:cache_config_info has the cache settings and engine as labels, no model_name (as vLLM's)
    assert all('model_name="demo"' in k and 'engine="0"' in k for k in before if "cache_config_info" not in k)
    info = next(k for k in before if k.startswith("vllm:cache_config_info{"))
    assert 'block_size="16"' in info and 'engine="0"' in info and 'num_gpu_blocks="' in info
    assert not [k for k in before if k.split("{")[0].endswith("_created")]  # vLLM exports none
    text = httpx.get(server.url + "/metrics", timeout=30).text  # and the process / Python series of vLLM's registry
    assert "\nprocess_resident_memory_bytes " in text and "\npython_info{" in text
    server.client().completions.create(model=MODEL, prompt="Count: 1, 2,", max_tokens=4, temperature=0,
                                       extra_body={"ignore_eos": True})
    after = wait_until_idle(server)

    def delta(name, **labels):
        key = next(k for k in after if k.split("{")[0] == name and all(f'{n}="{v}"' in k for n, v in labels.items()))
        return after[key] - before.get(key, 0.0)
    assert delta("vllm:generation_tokens_total") == 4
    assert delta("vllm:prompt_tokens_total") > 0
    assert delta("vllm:request_success_total", finished_reason="length") == 1
    assert delta("vllm:e2e_request_latency_seconds_count") == 1
    assert delta("vllm:inter_token_latency_seconds_count") == 3
    assert delta("vllm:time_per_output_token_seconds_count") == 3
    assert delta("vllm:prefix_cache_queries_total") > 0
    for name in ("request_prefill_time_seconds", "request_decode_time_seconds", "request_inference_time_seconds",
                 "request_time_per_output_token_seconds", "request_params_n"):
        assert delta(f"vllm:{name}_count") == 1, name
    assert delta("vllm:request_params_max_tokens_sum") == 4
    assert delta("vllm:request_max_num_generation_tokens_sum") == 4
    assert delta("vllm:iteration_tokens_total_sum") == delta("vllm:prompt_tokens_total") + 4


def test_client_disconnect_mid_stream_frees_everything(server):
    aborted = server.metric("vllm:request_success_total", finished_reason="abort")
    with server.http() as http:
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as r:
            seen = 0
            for line in r.iter_lines():
                seen += line.startswith("data: ")
                if seen == 3:
                    break
    wait_until_idle(server, timeout_s=30)
    assert server.metric("vllm:request_success_total", finished_reason="abort") == aborted + 1


def test_client_disconnect_non_streaming_frees_everything(server):
    aborted = server.metric("vllm:request_success_total", finished_reason="abort")
    with server.http() as http:
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/chat/completions", timeout=2,
                      json={"model": MODEL, "messages": CHAT, "max_tokens": 1500, "ignore_eos": True})
    wait_until_idle(server, timeout_s=30)
    assert server.metric("vllm:request_success_total", finished_reason="abort") == aborted + 1


def test_overload_gives_503_with_retry_after(server):
    """--max-num-seqs 4 --max-waiting-requests 3: a burst of 4 all run (the free slots take them: nothing waits);
    of 10 long concurrent requests, at least 3 get a 503."""
    async def run(count: int):
        async with httpx.AsyncClient(base_url=server.url, timeout=60,
                                     headers={"Authorization": f"Bearer {API_KEY}"}) as http:
            async def one():
                body = {"model": MODEL, "prompt": "Go", "max_tokens": 1000, "ignore_eos": True, "stream": True}
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        return r.status_code, r.headers.get("retry-after"), json.loads(await r.aread())
                    async for _ in r.aiter_lines():
                        await asyncio.sleep(3)  # hold the slot for a while, then go away
                        return 200, None, None
            return await asyncio.gather(*[one() for _ in range(count)])
    wait_until_idle(server, timeout_s=60)
    assert [r[0] for r in asyncio.run(run(4))] == [200] * 4
    wait_until_idle(server, timeout_s=60)
    results = asyncio.run(run(10))
    rejected = [r for r in results if r[0] == 503]
    assert len(rejected) >= 3, results
    assert all(r[1] and r[2]["error"]["code"] == 503 for r in rejected)
    wait_until_idle(server, timeout_s=60)


def test_no_internal_errors_logged(server):
    """Every bad input of this module and test_errors.py must have been answered without a 500."""
    time.sleep(0.2)
    assert "Unexpected error" not in server.read_log()
    assert "Traceback" not in server.read_log()
