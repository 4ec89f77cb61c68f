"""The chat glue with the real qwen3 / qwen3_coder parsers and the Qwen3.5 tokenizer, on scripted outputs.

The demo model never writes `<think>` or `<tool_call>`, so here a scripted engine plays Qwen3.5: the
app is the real one (in-process), only the engine is a double with AsyncLLM's surface.
"""

import asyncio
import json
from types import SimpleNamespace

import httpx
import pytest
from fastapi.testclient import TestClient

from ascendserve.engine.outputs import CompletionOutput, RequestOutput
from ascendserve.entrypoints.openai.api_server import build_app
from ascendserve.entrypoints.openai.protocol import ChatCompletionRequest
from ascendserve.entrypoints.openai.serving_chat import ChatChoiceParser
from ascendserve.entrypoints.openai.serving_engine import ServerOptions
from ascendserve.entrypoints.openai.serving_models import ServingModels
from ascendserve.parsers.reasoning import get_reasoning_parser
from ascendserve.parsers.tool import get_tool_parser
from tests.fixtures.qwen3_5_tokenizer import load_qwen3_5_tokenizer

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}}}}}]
CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
REASONING_THEN_CALL = "The user wants weather.\n</think>\n\n" + CALL
REASONING_THEN_ANSWER = "Think about it.\n</think>\n\nIt is sunny."


@pytest.fixture(scope="module")
def tokenizer():
    return load_qwen3_5_tokenizer()


def pieces_of(tokenizer, text: str) -> list[tuple[str, list[int]]]:
    """The text as the engine streams it: one (text, [token id]) per token."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return [(tokenizer.decode([i], skip_special_tokens=False), [i]) for i in ids]


def make_parser(tokenizer, request, prefix=""):
    reasoning = get_reasoning_parser("qwen3")(tokenizer, request.chat_template_kwargs)
    tool = get_tool_parser("qwen3_coder")(tokenizer) if request.tools else None
    return ChatChoiceParser(request, None if prefix else reasoning, tool, prefix)


def stream_through(parser: ChatChoiceParser, pieces) -> dict:
    """Feed pieces, then finish; return the concatenated fields."""
    out = {"reasoning": "", "content": "", "calls": {}}
    deltas = [parser.feed(text, ids) for text, ids in pieces] + [parser.finish()]
    for d in deltas:
        if d is None:
            continue
        out["reasoning"] += d.reasoning_content or ""
        out["content"] += d.content or ""
        for call in d.tool_calls:
            entry = out["calls"].setdefault(call.index, {"name": None, "arguments": ""})
            entry["name"] = entry["name"] or call.function.name
            entry["arguments"] += call.function.arguments or ""
    return out


@pytest.mark.parametrize("text, tools", [(REASONING_THEN_ANSWER, None), (REASONING_THEN_CALL, TOOLS),
                                         ("plain answer, no thinking tags", None)])
def test_streamed_deltas_add_up_to_the_non_streamed_message(tokenizer, text, tools):
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=tools)
    streamed = stream_through(make_parser(tokenizer, request), pieces_of(tokenizer, text))
    full = make_parser(tokenizer, request).parse(text)
    assert streamed["reasoning"] == (full.reasoning_content or "")
    assert streamed["content"].strip() == (full.content or "").strip()
    assert [c["name"] for c in streamed["calls"].values()] == [c.function.name for c in full.tool_calls]
    for streamed_call, call in zip(streamed["calls"].values(), full.tool_calls):
        assert json.loads(streamed_call["arguments"]) == json.loads(call.function.arguments)


def test_reasoning_then_call(tokenizer):
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=TOOLS)
    message = make_parser(tokenizer, request).parse(REASONING_THEN_CALL)
    assert message.reasoning_content == "The user wants weather.\n" and message.reasoning == message.reasoning_content
    assert message.content is None
    assert json.loads(message.tool_calls[0].function.arguments) == {"city": "Paris", "days": 3}


def test_thinking_disabled_is_all_content(tokenizer):
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}],
                                    chat_template_kwargs={"enable_thinking": False})
    streamed = stream_through(make_parser(tokenizer, request), pieces_of(tokenizer, "Hello there"))
    assert streamed == {"reasoning": "", "content": "Hello there", "calls": {}}


def test_forced_prefix_makes_a_call_of_any_output(tokenizer):
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=TOOLS,
                                    tool_choice={"type": "function", "function": {"name": "get_weather"}})
    prefix = "<tool_call>\n<function=get_weather>\n"
    for text in ["<parameter=city>\nRome\n", "", "garbage text"]:
        streamed = stream_through(make_parser(tokenizer, request, prefix), pieces_of(tokenizer, text))
        assert [c["name"] for c in streamed["calls"].values()] == ["get_weather"]
        assert isinstance(json.loads(streamed["calls"][0]["arguments"]), dict)
        assert not streamed["content"]


# -- the app with a scripted engine ----------------------------------------------------------------

class ScriptedEngine:
    """AsyncLLM's surface; every request 'generates' `script`, one token per output."""

    def __init__(self, tokenizer, script: str = REASONING_THEN_CALL, num_waiting: int = 0) -> None:
        self.tokenizer = tokenizer
        self.config = SimpleNamespace(max_model_len=4096)
        self.script = script
        self.num_waiting = num_waiting
        self.errored = False
        self.prompts: list[dict] = []
        self.params: list = []
        self.aborted: list[str] = []

    async def add_request(self, request_id, prompt, params):
        self.prompts.append(prompt)
        self.params.append(params)
        pieces = pieces_of(self.tokenizer, self.script)[:params.max_tokens]
        return _ScriptedStream(self, request_id, prompt["prompt_token_ids"], pieces, params.max_tokens)


class _ScriptedStream:
    def __init__(self, engine, request_id, prompt_ids, pieces, max_tokens):
        self.engine, self.request_id, self.prompt_ids = engine, request_id, prompt_ids
        self.pieces, self.finished, self.max_tokens = list(pieces), False, max_tokens

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.pieces:
            raise StopAsyncIteration
        text, ids = self.pieces.pop(0)
        last = not self.pieces
        reason = ("length" if self.max_tokens == len(ids) else "stop") if last else None
        self.finished = last
        return RequestOutput(self.request_id, None, self.prompt_ids,
                             [CompletionOutput(0, text, ids, None, None, reason)], last)

    def abort(self):
        if not self.finished:
            self.finished = True
            self.engine.aborted.append(self.request_id)


def make_client(engine, **options) -> TestClient:
    opts = ServerOptions(reasoning_parser="qwen3", tool_call_parser="qwen3_coder", enable_auto_tool_choice=True,
                         log_requests=False)
    for key, value in options.items():
        setattr(opts, key, value)
    tool_cls = get_tool_parser("qwen3_coder") if opts.tool_call_parser else None
    app = build_app(engine, ServingModels(["qwen3.5"], "/models/qwen3.5", 4096), opts,
                    reasoning_parser_cls=get_reasoning_parser("qwen3"), tool_parser_cls=tool_cls)
    return TestClient(app)


def test_app_non_streaming_reasoning_and_tool_calls(tokenizer):
    client = make_client(ScriptedEngine(tokenizer))
    body = {"model": "qwen3.5", "messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS}
    choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["reasoning_content"] == "The user wants weather.\n"
    assert choice["message"]["reasoning"] == "The user wants weather.\n"
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris", "days": 3}


def test_app_streaming_reasoning_and_tool_calls(tokenizer):
    client = make_client(ScriptedEngine(tokenizer))
    body = {"messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS, "stream": True}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0]["role"] == "assistant"
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "The user wants weather.\n"
    assert not "".join(d.get("content") or "" for d in deltas).strip()
    calls = [tc for d in deltas for tc in d.get("tool_calls") or []]
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert json.loads("".join(tc["function"]["arguments"] or "" for tc in calls)) == {"city": "Paris", "days": 3}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def stream_deltas(client, body) -> tuple[list[dict], list[dict]]:
    """(deltas, chunks) of a streamed chat completion."""
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        chunks = [json.loads(line[len("data: "):]) for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    return [c["choices"][0]["delta"] for c in chunks if c["choices"]], chunks


def test_app_parallel_tool_calls_false_keeps_the_first_call(tokenizer):
    second = CALL.replace("Paris", "Oslo")
    body = {"messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS}
    for parallel, cities in [(None, ["Paris", "Oslo"]), (True, ["Paris", "Oslo"]), (False, ["Paris"])]:
        client = make_client(ScriptedEngine(tokenizer, script=REASONING_THEN_CALL + "\n" + second))
        extra = {} if parallel is None else {"parallel_tool_calls": parallel}
        message = client.post("/v1/chat/completions", json={**body, **extra}).json()["choices"][0]["message"]
        assert [json.loads(c["function"]["arguments"])["city"] for c in message["tool_calls"]] == cities
        deltas, chunks = stream_deltas(client, {**body, **extra})
        calls = [tc for d in deltas for tc in d.get("tool_calls") or []]
        assert sorted({tc["index"] for tc in calls}) == list(range(len(cities)))
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_app_history_and_continuation_readings(tokenizer):
    """A replayed call whose arguments are "" / null / not an object renders with {} (was a 400 from the template);
    continue_final_message after a turn whose thinking the template closed streams content, not reasoning; echo
    returns an assistant message given as content parts."""
    engine = ScriptedEngine(tokenizer, script=" sunny today.")
    client = make_client(engine)
    for arguments in ("", None, "[1, 2]", "{broken"):
        history = [{"role": "user", "content": "Time?"},
                   {"role": "assistant", "content": None, "tool_calls": [
                       {"id": "c1", "type": "function", "function": {"name": "now", "arguments": arguments}}]},
                   {"role": "tool", "tool_call_id": "c1", "content": "12:00"}]
        r = client.post("/v1/chat/completions", json={"messages": history})
        assert r.status_code == 200, (arguments, r.text)
        assert "<function=now>\n</function>" in engine.prompts[-1]["prompt"]
    cont = {"messages": [{"role": "user", "content": "Weather?"},
                         {"role": "assistant", "content": [{"type": "text", "text": "The answer is"}]}],
            "continue_final_message": True, "add_generation_prompt": False, "echo": True}
    message = client.post("/v1/chat/completions", json=cont).json()["choices"][0]["message"]
    assert engine.prompts[-1]["prompt"].endswith("</think>\n\nThe answer is")
    assert message["content"] == "The answer is sunny today." and message["reasoning_content"] is None
    deltas, _ = stream_deltas(client, cont)
    assert "".join(d.get("content") or "" for d in deltas) == "The answer is sunny today."
    assert not any(d.get("reasoning_content") for d in deltas)


def test_app_server_wide_chat_options(tokenizer):
    """--default-chat-template-kwargs under the request's own (thinking off server-wide: the prompt closes it and the
    reply is content); --exclude-tools-when-tool-choice-none; --enable-force-include-usage on both endpoints."""
    engine = ScriptedEngine(tokenizer, script="Hi there.")
    client = make_client(engine, default_chat_template_kwargs={"enable_thinking": False},
                         exclude_tools_when_tool_choice_none=True, enable_force_include_usage=True)
    ask = [{"role": "user", "content": "Hi"}]
    message = client.post("/v1/chat/completions", json={"messages": ask}).json()["choices"][0]["message"]
    assert engine.prompts[-1]["prompt"].endswith("<think>\n\n</think>\n\n")
    assert message["content"] == "Hi there." and message["reasoning_content"] is None
    client.post("/v1/chat/completions", json={"messages": ask, "chat_template_kwargs": {"enable_thinking": True}})
    assert engine.prompts[-1]["prompt"].endswith("<think>\n")  # the request's own value wins
    client.post("/v1/chat/completions", json={"messages": ask, "tools": TOOLS, "tool_choice": "none"})
    assert "get_weather" not in engine.prompts[-1]["prompt"]
    tokenized = client.post("/tokenize", json={"messages": ask, "tools": TOOLS})  # no tool_choice on /tokenize
    assert tokenized.status_code == 200 and tokenized.json()["count"] > 0
    client.post("/v1/chat/completions", json={"messages": ask, "tools": TOOLS})
    assert "get_weather" in engine.prompts[-1]["prompt"]
    _, chunks = stream_deltas(client, {"messages": ask})
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == len(pieces_of(tokenizer,
                                                                                                      "Hi there."))
    with client.stream("POST", "/v1/completions", json={"prompt": "x", "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["prompt_tokens"] == 1


def test_app_named_tool_choice_with_thinking_off_puts_the_opening_in_the_prompt(tokenizer):
    engine = ScriptedEngine(tokenizer, script="<parameter=city>\nOslo\n</parameter>\n")
    client = make_client(engine)
    body = {"messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "chat_template_kwargs": {"enable_thinking": False}}
    choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert engine.prompts[0]["prompt"].endswith("</think>\n\n<tool_call>\n<function=get_weather>\n")
    assert engine.prompts[0]["prompt_token_ids"] == tokenizer.encode(engine.prompts[0]["prompt"])
    assert engine.params[0].structured_outputs_wait_for is None
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}
    assert choice["message"]["content"] is None and choice["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_app_forced_tool_choice_thinks_first(tokenizer, tool_choice):
    """A prompt that leaves <think> open: the model thinks, then the call's grammar (opening included) holds from the
    token after </think> (vLLM's order; the opening used to be put in the prompt after a forced </think>)."""
    engine = ScriptedEngine(tokenizer)  # thinking, </think>, then the call
    client = make_client(engine)
    body = {"messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS, "tool_choice": tool_choice}
    choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert engine.prompts[0]["prompt"].endswith("<|im_start|>assistant\n<think>\n")
    params = engine.params[0]
    assert params.structured_outputs_wait_for == tokenizer.convert_tokens_to_ids("</think>")
    assert "<function=" in params.structured_outputs.grammar and "LEAD_SPACE" in params.structured_outputs.grammar
    assert choice["message"]["reasoning_content"] == "The user wants weather.\n"
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris", "days": 3}
    assert choice["finish_reason"] == "tool_calls"
    engine.script = "Still thinking when max_tokens ran out"  # no call, cut short: returned as it is
    r = client.post("/v1/chat/completions", json={**body, "max_tokens": 1})  # the scripted engine's "length"
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    engine.script = REASONING_THEN_ANSWER  # ended without a call: an error (a 400, as vLLM's), never text
    assert client.post("/v1/chat/completions", json=body).status_code == 400


def test_app_auto_tool_choice_needs_the_flag(tokenizer):
    client = make_client(ScriptedEngine(tokenizer), enable_auto_tool_choice=False)
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "tools": TOOLS,
                                                  "tool_choice": "auto"})
    assert r.status_code == 400 and "--enable-auto-tool-choice" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "tool_choice"
    client = make_client(ScriptedEngine(tokenizer), tool_call_parser=None, enable_auto_tool_choice=False)
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "tools": TOOLS,
                                                  "tool_choice": "required"})
    assert r.status_code == 400 and "--tool-call-parser" in r.json()["error"]["message"]


def test_app_overload_and_dead_engine(tokenizer):
    engine = ScriptedEngine(tokenizer, num_waiting=5)
    client = make_client(engine, max_waiting_requests=5)
    r = client.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["type"] == "ServiceUnavailableError"
    engine.num_waiting = 0
    engine.shutting_down = True  # SIGTERM received: a request still arriving on an open connection is refused
    r = client.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
    engine.errored = True
    assert client.get("/health").status_code == 503


def test_long_prompts_tokenize_off_the_event_loop(tokenizer):
    """A long prompt is tokenized on the tokenizer thread: other coroutines run meanwhile (a synchronous encode
    would let none of them in), and the ids are the tokenizer's."""
    from ascendserve.entrypoints.openai.serving_engine import OFF_LOOP_TOKENIZE_CHARS, OpenAIServing

    serving = OpenAIServing(ScriptedEngine(tokenizer), ServingModels(["qwen3.5"], "/m", 4096), ServerOptions())
    text = "The quick brown fox jumps over the lazy dog. 你好世界 " * 2000
    assert len(text) >= OFF_LOOP_TOKENIZE_CHARS

    async def run():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.ensure_future(ticker())
        await asyncio.sleep(0)
        before = ticks
        ids = await serving.tokenize(text, add_special_tokens=False)
        task.cancel()
        return ids, ticks - before

    ids, ticks = asyncio.run(run())
    assert ids == tokenizer.encode(text, add_special_tokens=False)
    assert ticks > 1


class CountingEngine(ScriptedEngine):
    """Counts every added request as waiting (none ever runs), as AsyncLLM counts a pending add."""

    async def add_request(self, request_id, prompt, params):
        self.num_waiting += 1
        return await super().add_request(request_id, prompt, params)


def test_waiting_limit_holds_while_prompts_tokenize(tokenizer):
    """--max-waiting-requests 2 and four long prompts sent together: all four pass the check on arrival (nothing
    waits yet) and then wait for the tokenizer thread; the check before the add lets exactly two in."""
    engine = CountingEngine(tokenizer, script="ok")
    app = make_client(engine, max_waiting_requests=2).app
    prompt = "word " * 1000

    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            return await asyncio.gather(*[http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
                                          for _ in range(4)])

    statuses = sorted(r.status_code for r in asyncio.run(run()))
    assert statuses == [200, 200, 503, 503] and engine.num_waiting == 2


def test_app_cors_follows_the_flags(tokenizer):
    app = build_app(ScriptedEngine(tokenizer), ServingModels(["qwen3.5"], "/m", 4096), ServerOptions(),
                    cors={"allowed_origins": ["http://good.example"], "allowed_methods": ["POST"],
                          "allowed_headers": ["Authorization", "Content-Type"]})
    client = TestClient(app)
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "Authorization"}
    ok = client.options("/v1/completions", headers={"Origin": "http://good.example", **preflight})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "http://good.example"
    bad = client.options("/v1/completions", headers={"Origin": "http://evil.example", **preflight})
    assert bad.status_code == 400 and "access-control-allow-origin" not in bad.headers


def test_stats_log_line_like_vllm():
    from ascendserve.metrics import EngineMetrics, IterationStats, SchedulerStats

    metrics = EngineMetrics("m", 2048)
    assert metrics.log() is None  # idle: nothing to say
    metrics.record(SchedulerStats(num_running=2, num_waiting=1, kv_cache_usage=0.25, prefix_cache_requests=2,
                                  prefix_cache_queries=100, prefix_cache_hits=40),
                   IterationStats(num_prompt_tokens=50, num_generation_tokens=10))
    line = metrics.log()
    for part in ["Avg prompt throughput:", "Avg generation throughput:", "Running: 2 reqs", "Waiting: 1 reqs",
                 "GPU KV cache usage: 25.0%", "Prefix cache hit rate: 40.0%"]:
        assert part in line, line
    cpu = EngineMetrics("m", 2048, device_type="cpu")
    cpu.record(SchedulerStats(num_running=1, kv_cache_usage=0.5), IterationStats(num_generation_tokens=3))
    assert "CPU KV cache usage: 50.0%" in cpu.log() and "GPU" not in cpu.log(force=True)


def test_app_structured_outputs_wait_for_the_end_of_thinking(tokenizer):
    """Qwen3.5 with the qwen3 reasoning parser: a prompt that leaves <think> open gets its JSON constraint (and a
    forced call its grammar) from the token after </think>; with thinking off (closed in the prompt) from the first
    token."""
    engine = ScriptedEngine(tokenizer, script="{}")
    client = make_client(engine)
    body = {"messages": [{"role": "user", "content": "JSON?"}], "response_format": {"type": "json_object"}}
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    assert client.post("/v1/chat/completions", json={**body, "chat_template_kwargs": {"enable_thinking": False}}
                       ).status_code == 200
    forced = {"messages": body["messages"], "tools": TOOLS, "tool_choice": "required", "max_tokens": 1}
    assert client.post("/v1/chat/completions", json=forced).status_code == 200
    think_end = tokenizer.convert_tokens_to_ids("</think>")
    assert [p.structured_outputs_wait_for for p in engine.params] == [think_end, None, think_end]
    assert engine.params[0].structured_outputs.json_object and engine.params[2].structured_outputs.grammar


HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'


@pytest.mark.parametrize("parser, tool_choice, thinking, script", [
    ("qwen3_coder", {"type": "function", "function": {"name": "get_weather"}}, True, REASONING_THEN_CALL),
    ("qwen3_coder", "required", True, REASONING_THEN_CALL),
    ("qwen3_coder", "required", False, CALL.removeprefix("<tool_call>\n<function=get_weather>\n")),
    ("hermes", "required", True, "The user wants weather.\n</think>\n\n" + HERMES_CALL),
    ("hermes", {"type": "function", "function": {"name": "get_weather"}}, False,
     HERMES_CALL.removeprefix('<tool_call>\n{"name": "get_weather", "arguments": ')),
])
def test_app_forced_call_grammars_take_qwen35s_call_tags_as_their_tokens(tokenizer, parser, tool_choice, thinking,
                                                                          script):
    """Qwen3.5 writes <tool_call> and </tool_call> as one token each (248058, 248059). The forced call's grammar had
    them as text: llguidance's mask let the token through, then refused it, and the rest of the output ran
    unconstrained to max_tokens. The grammar the server builds now takes the model's own tokens to the call's end."""
    from ascendserve.engine.structured_output import GrammarCompiler

    engine = ScriptedEngine(tokenizer, script="x")
    opts = ServerOptions(reasoning_parser="qwen3", tool_call_parser=parser, enable_auto_tool_choice=True,
                         log_requests=False)
    app = build_app(engine, ServingModels(["qwen3.5"], "/models/qwen3.5", 4096), opts,
                    reasoning_parser_cls=get_reasoning_parser("qwen3"), tool_parser_cls=get_tool_parser(parser))
    body = {"messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS, "tool_choice": tool_choice,
            "chat_template_kwargs": {"enable_thinking": thinking}, "max_tokens": 1}
    assert TestClient(app).post("/v1/chat/completions", json=body).status_code == 200
    params = engine.params[0]
    state, = GrammarCompiler(tokenizer, 248320, [248046, 248044]).compile(params.structured_outputs, 1,
                                                                         params.structured_outputs_wait_for)
    ids = tokenizer.encode(script, add_special_tokens=False)
    assert {248058, 248059} & set(ids) or not thinking  # the tags are in the output as their tokens
    for token in ids:
        state.accept(token)
        assert not state.failed, (tokenizer.decode([token]), state.matcher.get_error())
    if not state.ended:  # "required": further calls may follow until the turn ends
        state.accept(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    assert state.ended and not state.failed


def test_app_a_forced_call_the_model_never_made_is_a_400(tokenizer):
    """The model ended its turn inside its thinking, before the call's grammar began: a 400 naming tool_choice, as
    vLLM's (a 500 had the openai client send the request twice more, generating each time)."""
    client = make_client(ScriptedEngine(tokenizer, script="I could call a tool, but I will not."))
    body = {"messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS, "tool_choice": "required"}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text
    assert "ended its turn without a call" in r.json()["error"]["message"]
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as stream:
        events = [line[len("data: "):] for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == 400, events
