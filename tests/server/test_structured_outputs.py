"""Structured outputs through the server: response_format, vLLM's structured_outputs and guided_* fields, and the
grammar behind a forced tool call (tool_choice required / named), with both tool-call parsers."""

import json
import re

import pytest

from tests.server.test_openai_server import sse_events
from tests.server.utils import API_KEY, MODEL, RemoteServer, server  # noqa: F401

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}, "days": {"type": "integer"}},
             "required": ["city"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
             "additionalProperties": False}}}]


def is_person(text: str) -> bool:
    value = json.loads(text)
    return set(value) == {"name", "age"} and isinstance(value["age"], int) and len(value["name"]) <= 12


def test_response_format_json_schema_and_json_object(server):
    client = server.client()
    schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for seed in range(3):
        out = client.chat.completions.create(model=MODEL, messages=ASK, response_format=schema, max_tokens=80,
                                             temperature=1.0, seed=seed)
        assert out.choices[0].finish_reason == "stop" and is_person(out.choices[0].message.content)
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, response_format=schema, max_tokens=80,
                                                 temperature=0, stream=True))
    assert is_person("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
    out = client.chat.completions.create(model=MODEL, messages=ASK, response_format={"type": "json_object"},
                                         max_tokens=200, temperature=0, seed=0)
    if out.choices[0].finish_reason == "stop":  # the demo may write a long object: only a finished one must parse
        assert isinstance(json.loads(out.choices[0].message.content), dict)
    assert out.choices[0].message.content.lstrip().startswith("{")


def test_vllm_structured_outputs_and_guided_fields_on_completions(server):
    client = server.client()
    cases = [({"structured_outputs": {"choice": ["yes", "no"]}}, lambda t: t in ("yes", "no")),
             ({"guided_choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
             ({"guided_regex": r"[0-9]{3}-[0-9]{4}"}, lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)),
             ({"structured_outputs": {"regex": r"[A-Z][a-z]+"}}, lambda t: re.fullmatch(r"[A-Z][a-z]+", t)),
             ({"guided_json": PERSON}, is_person),
             ({"structured_outputs": {"grammar": 'start: "a" ("b" | "c")+ "d"'}},
              lambda t: re.fullmatch(r"a[bc]+d", t))]
    for body, check in cases:
        out = client.completions.create(model=MODEL, prompt="Answer:", max_tokens=60, temperature=0.7, seed=1,
                                        n=2, extra_body=body)
        for choice in out.choices:
            if choice.finish_reason == "length" and "grammar" in body.get("structured_outputs", {}):
                # the grammar's (b|c)+ has no bound: the demo may repeat "c" to max_tokens; what it wrote so far
                # must still be a prefix the grammar allows
                assert re.fullmatch(r"a[bc]*", choice.text), (body, choice.text)
            else:
                assert check(choice.text), (body, choice.text)
    with server.http() as http:  # streamed, the pieces join into a valid output
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Phone:", "max_tokens": 20, "stream": True,
                                                "guided_regex": r"\+[0-9]{2} [0-9]{4}"})
        text = "".join(e["choices"][0]["text"] for e in sse_events(r) if e["choices"])
        assert re.fullmatch(r"\+[0-9]{2} [0-9]{4}", text), text


@pytest.mark.parametrize("body, param, contains", [
    ({"guided_regex": "[a"}, "guided_regex", "regex could not be compiled"),
    ({"guided_json": {"type": "nope"}}, "guided_json", "JSON schema could not be compiled"),
    ({"structured_outputs": {"grammar": "start: nowhere"}}, "structured_outputs", "grammar could not be compiled"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex", "give one of them"),
    ({"structured_outputs": {"jsn": {}}}, "structured_outputs", "unknown constraint"),
    ({"structured_outputs": {"choice": ["a"], "regex": "b"}}, "structured_outputs", "structured outputs"),
    ({"guided_choice": []}, "guided_choice", "choice must be a non-empty list"),  # param was null for these
    ({"response_format": {"type": "structural_tag"}}, "response_format", "not supported"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
     "json_schema.schema"),
])
def test_bad_constraints_are_400s_naming_the_field(server, body, param, contains):
    with server.http() as http:
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 3, **body})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert contains in error["message"] and error["param"] == param, error


def test_forced_tool_call_and_response_format_conflict(server):
    with server.http() as http:
        r = http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": ASK, "tools": TOOLS, "tool_choice": "required",
            "response_format": {"type": "json_object"}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text


def test_qwen3_coder_forced_calls_name_a_tool_and_typed_arguments(server):
    """The shared server's parser: the grammar keeps a required call to the given tools and its JSON-typed
    parameters (days: an integer) to their schema; the call always parses."""
    client = server.client()
    for seed in range(4):
        out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather?"}],
                                             tools=TOOLS, tool_choice="required", max_tokens=80, temperature=1.0,
                                             seed=seed)
        choice = out.choices[0]
        assert choice.finish_reason in ("tool_calls", "length"), choice
        if choice.finish_reason == "tool_calls":
            call = choice.message.tool_calls[0]
            arguments = json.loads(call.function.arguments)
            assert call.function.name in ("get_weather", "get_time")
            assert isinstance(arguments.get("days", 0), int) and arguments.get("zone", "UTC") in ("UTC", "CET")
            assert {"get_weather": "city", "get_time": "zone"}[call.function.name] in arguments  # required
    bad = [{"type": "function", "function": {"name": "get weather", "parameters": {"type": "object"}}}]
    with server.http() as http:  # a name qwen3_coder's parser would drop: a forced call could never parse
        for choice in ("required", {"type": "function", "function": {"name": "get weather"}}):
            r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "tools": bad,
                                                        "tool_choice": choice})
            assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
            assert "'get weather' cannot be written" in r.json()["error"]["message"]


@pytest.fixture(scope="module")
def hermes_server():
    remote = RemoteServer(["--max-model-len", "2048", "--kv-cache-memory-bytes", str(256 * 2**20),
                           "--served-model-name", MODEL, "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                           "--api-key", API_KEY, "--uvicorn-log-level", "warning", "--disable-log-stats"])
    yield remote
    remote.stop()


def test_hermes_forced_calls_always_parse_and_follow_the_schema(hermes_server):
    """hermes (JSON arguments): required over two tools and a named one, sampled with several seeds, streamed and
    not: every finished reply is one call whose arguments satisfy that tool's schema. Without the grammar this gave
    500s (the demo wrote arguments like "3")."""
    client = hermes_server.client()
    checks = {"get_weather": lambda a: set(a) <= {"city", "days"} and isinstance(a["city"], str),
              "get_time": lambda a: set(a) == {"zone"} and a["zone"] in ("UTC", "CET")}
    named = {"type": "function", "function": {"name": "get_time"}}
    finished = 0
    for choice, seed in [("required", 0), ("required", 1), ("required", 2), (named, 0), (named, 1)]:
        out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                             tools=TOOLS, tool_choice=choice, max_tokens=80, temperature=1.0, seed=seed)
        reply = out.choices[0]
        if reply.finish_reason == "length":
            continue
        finished += 1
        # "required": one call or more (vLLM's), each valid; a named function: that one call
        assert reply.finish_reason == "tool_calls" and len(reply.message.tool_calls) >= 1, reply
        assert choice == "required" or len(reply.message.tool_calls) == 1
        for call in (c.function for c in reply.message.tool_calls):
            assert choice == "required" or call.name == "get_time"
            assert checks[call.name](json.loads(call.arguments)), call
    assert finished >= 3
    for seed in range(3):  # parallel calls off: one call
        out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                             tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                                             max_tokens=80, temperature=1.0, seed=seed)
        assert len(out.choices[0].message.tool_calls) == 1 or out.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Time?"}],
                                                 tools=TOOLS, tool_choice=named, max_tokens=80, temperature=0,
                                                 stream=True))
    deltas = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "get_time"
    assert checks["get_time"](json.loads("".join(d.function.arguments or "" for d in deltas)))
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_streamed_tool_calls_work_with_the_openai_stream_helper(hermes_server):
    """The openai client's stream helper accumulates the deltas: a continuation that carried `"type": null` (and
    `"id": null`) overwrote the call's type, and the helper failed an assertion. Deltas leave out what they do not
    carry, as OpenAI's and vLLM's do."""
    client = hermes_server.client()
    stream = getattr(client.chat.completions, "stream", None) or client.beta.chat.completions.stream
    named = {"type": "function", "function": {"name": "get_time"}}
    with stream(model=MODEL, messages=[{"role": "user", "content": "Time?"}], tools=TOOLS, tool_choice=named,
                max_tokens=80, temperature=0) as events:
        for _ in events:
            pass
        final = events.get_final_completion()
    call = final.choices[0].message.tool_calls[0]
    assert (call.type, call.function.name) == ("function", "get_time") and call.id.startswith("call_")
    assert json.loads(call.function.arguments)["zone"] in ("UTC", "CET")
    with hermes_server.http() as http:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Time?"}], "tools": TOOLS,
                "tool_choice": named, "max_tokens": 80, "temperature": 0, "stream": True}
        deltas = [e["choices"][0]["delta"] for e in sse_events(http.post("/v1/chat/completions", json=body))
                  if e["choices"]]
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert calls[0]["type"] == "function" and all(set(tc) == {"index", "function"} for tc in calls[1:]), calls
    assert all(None not in d.values() for d in deltas), deltas


def test_hermes_server_logged_no_internal_error(hermes_server):
    assert "Unexpected error" not in hermes_server.read_log()
