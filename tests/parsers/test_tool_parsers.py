"""The qwen3_coder and hermes tool parsers, whole and streamed token by token with the Qwen3.5 tokenizer."""

import json
import re

import pytest

from ascendserve.entrypoints.openai.protocol import ChatCompletionRequest
from ascendserve.parsers import ParserNotFoundError
from ascendserve.parsers.reasoning import get_reasoning_parser
from ascendserve.parsers.tool import Hermes2ProToolParser, Qwen3CoderToolParser, get_tool_parser
from tests.fixtures import token_deltas
from tests.fixtures.qwen3_5_tokenizer import load_qwen3_5_tokenizer


def tool(name: str, properties: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object",
                                                                          "properties": properties}}}


TOOLS = [
    tool("get_weather", {"city": {"type": "string"}, "state": {"type": "string"},
                         "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}, "days": {"type": "integer"}}),
    tool("calculate_area", {"shape": {"type": "string"}, "dimensions": {"type": "object"},
                            "precision": {"type": "integer"}}),
    tool("typed", {"i": {"type": "integer"}, "f": {"type": "number"}, "b": {"type": "boolean"},
                   "s": {"type": "string"}, "o": {"type": "object"}, "a": {"type": "array"},
                   "n": {"type": "integer"}, "ns": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                   "ai": {"anyOf": [{"type": "integer"}, {"type": "null"}]}, "tl": {"type": ["integer", "null"]},
                   "sin": {"type": ["string", "integer", "null"]}, "lst": {"anyOf": [{"type": "array"},
                                                                                     {"type": "null"}]}}),
    tool("bash", {"command": {"type": "string"}}),
]


def xml_call(name: str, params: dict[str, str]) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


# (name, output, expected content, expected [(function name, arguments dict)])
QWEN3_CODER_CASES = [
    ("no_tools", "This is a test response without any tool calls", "This is a test response without any tool calls",
     []),
    ("single_tool", xml_call("get_weather", {"city": "Dallas", "state": "TX", "unit": "fahrenheit"}), None,
     [("get_weather", {"city": "Dallas", "state": "TX", "unit": "fahrenheit"})]),
    ("single_tool_with_content",
     "Sure! Let me check the weather for you." + xml_call("get_weather", {"city": "Dallas", "state": "TX"}),
     "Sure! Let me check the weather for you.", [("get_weather", {"city": "Dallas", "state": "TX"})]),
    ("multiline_param", xml_call("calculate_area", {"shape": "rectangle", "dimensions": '{"width": 10,\n "height": 20}',
                                                    "precision": "2"}), None,
     [("calculate_area", {"shape": "rectangle", "dimensions": {"width": 10, "height": 20}, "precision": 2})]),
    ("parallel_tools", "Checking both.\n\n" + xml_call("get_weather", {"city": "Dallas", "state": "TX"}) + "\n"
     + xml_call("get_weather", {"city": "Orlando", "state": "FL"}), "Checking both.\n\n",
     [("get_weather", {"city": "Dallas", "state": "TX"}), ("get_weather", {"city": "Orlando", "state": "FL"})]),
    ("typed_params", xml_call("typed", {"i": "42", "f": "3.14", "b": "true", "s": "007", "o": '{"k": [1, "v"]}',
                                        "a": "[1, 2]", "n": "None", "ns": "null", "ai": "5", "tl": "7", "sin": "12",
                                        "lst": "[\"x\"]"}), None,
     [("typed", {"i": 42, "f": 3.14, "b": True, "s": "007", "o": {"k": [1, "v"]}, "a": [1, 2], "n": None,
                 "ns": None, "ai": 5, "tl": 7, "sin": "12", "lst": ["x"]})]),
    ("string_looks_like_number", xml_call("get_weather", {"city": "12345", "state": "null", "days": "3"}), None,
     [("get_weather", {"city": "12345", "state": "null", "days": 3})]),
    ("not_in_schema_kept_as_string", xml_call("get_weather", {"city": "Paris", "extra": "42"}), None,
     [("get_weather", {"city": "Paris", "extra": "42"})]),
    ("unknown_function_all_strings", xml_call("unknown", {"x": "1", "y": "true"}), None,
     [("unknown", {"x": "1", "y": "true"})]),
    ("python_literal_object", xml_call("typed", {"o": "{'key': 'value', 'ok': True}"}), None,
     [("typed", {"o": {"key": "value", "ok": True}})]),
    ("bad_values_stay_strings", xml_call("typed", {"i": "forty", "b": "maybe", "o": "{not json"}), None,
     [("typed", {"i": "forty", "b": "maybe", "o": "{not json"})]),
    ("code_value_keeps_inner_newlines", xml_call("bash", {"command": "cd /tmp && \\\n  ls -la <dir>\n\nif a > b:\n"}),
     None, [("bash", {"command": "cd /tmp && \\\n  ls -la <dir>\n\nif a > b:\n"})]),
    ("unicode_values", "好的，我来查一下。" + xml_call("get_weather", {"city": "東京 🗼", "state": "関東"}),
     "好的，我来查一下。", [("get_weather", {"city": "東京 🗼", "state": "関東"})]),
    ("missing_closing_parameter",
     "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nDallas\n<parameter=state>\nTX\n"
     "</function>\n</tool_call>", "Let me check.\n", [("get_weather", {"city": "Dallas", "state": "TX"})]),
    ("truncated_at_end", "<tool_call>\n<function=get_weather>\n<parameter=city>\nDallas\n</parameter>\n"
     "<parameter=days>\n3", None, [("get_weather", {"city": "Dallas", "days": 3})]),
    ("fallback_no_tags", "Result:\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>",
     "Result:\n", [("get_weather", {"city": "Rome"})]),
    ("no_parameters", "<tool_call>\n<function=list_files>\n</function>\n</tool_call>", None, [("list_files", {})]),
    ("malformed_name_filtered", "<tool_call>\n<function=get weather\n</tool_call>\n"
     + xml_call("get_weather", {"city": "Oslo"}), None, [("get_weather", {"city": "Oslo"})]),
    ("whitespace_content_is_none", "\n\n" + xml_call("bash", {"command": "pwd"}), None,
     [("bash", {"command": "pwd"})]),
    # code that mentions the format's own tags: only a tag the next block (or the call's end) follows closes
    ("tags_inside_values", xml_call("bash", {"command": "echo '</parameter>' && grep -c '</function>' x.xml"}) + "\n"
     + xml_call("get_weather", {"city": "a</parameter>b", "state": "</function> TX"}), None,
     [("bash", {"command": "echo '</parameter>' && grep -c '</function>' x.xml"}),
      ("get_weather", {"city": "a</parameter>b", "state": "</function> TX"})]),
    ("repeated_parameter_keeps_first", xml_call("get_weather", {"city": "A"}).replace(
        "</function>", "<parameter=city>\nB\n</parameter>\n</function>"), None, [("get_weather", {"city": "A"})]),
]

HERMES_CASES = [
    ("no_tools", "Just text.", "Just text.", []),
    ("single", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Dallas", "days": 3}}\n</tool_call>',
     None, [("get_weather", {"city": "Dallas", "days": 3})]),
    ("with_content_and_parallel", 'Let me see. 好的\n<tool_call>\n{"name": "a", "arguments": {"x": [1, {"y": "z"}]}}'
     '\n</tool_call>\n<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>', "Let me see. 好的\n",
     [("a", {"x": [1, {"y": "z"}]}), ("b", {})]),
    ("arguments_first", '<tool_call>{"arguments": {"name": "inner"}, "name": "outer"}</tool_call>', None,
     [("outer", {"name": "inner"})]),
    ("string_arguments", '<tool_call>{"name": "f", "arguments": "{\\"q\\": 1}"}</tool_call>', None,
     [("f", {"q": 1})]),
    ("unclosed", '<tool_call>\n{"name": "f", "arguments": {"q": "v"}}', None, [("f", {"q": "v"})]),
    ("invalid_json_is_content", "Text <tool_call>{not json}</tool_call>", "Text <tool_call>{not json}</tool_call>",
     []),
    # Qwen3.5's XML calls under the wrong parser: nothing parses, the text stays content (was silently dropped)
    ("xml_call_is_content", "Let me look.\n" + xml_call("bash", {"command": "ls"}),
     "Let me look.\n" + xml_call("bash", {"command": "ls"}), []),
    # a string value that mentions the closing tag (a coding agent writing about tool calls) is not the call's end
    ("end_tag_inside_string", '<tool_call>\n{"name": "write", "arguments": {"text": "ends with </tool_call> \\" ok"'
     '}}\n</tool_call>\n<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>', None,
     [("write", {"text": 'ends with </tool_call> " ok'}), ("b", {})]),
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_qwen3_5_tokenizer()


def chat_request() -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=TOOLS)


def stream_tool_calls(parser, tokenizer, output: str, request, tokens_per_step: int = 1):
    """Stream `output` through the parser; return (content, {index: {"id", "name", "arguments"}})."""
    content, calls = [], {}
    deltas = [parser.extract_tool_calls_streaming(s.previous_text, s.current_text, s.delta_text,
                                                  s.previous_token_ids, s.current_token_ids, s.delta_token_ids,
                                                  request)
              for s in token_deltas(tokenizer, output, tokens_per_step)]
    deltas.append(parser.finish_streaming(output, request))
    for delta in filter(None, deltas):
        assert delta.role is None
        content.append(delta.content or "")
        for call in delta.tool_calls:
            collect_tool_call_delta(calls, call)
    return "".join(content), calls


def collect_tool_call_delta(calls: dict, call) -> None:
    if call.index not in calls:
        assert call.index == len(calls), "indexes must be consecutive"
        assert call.id and call.type == "function" and call.function.name, "the first delta is the header"
        calls[call.index] = {"id": call.id, "name": call.function.name, "arguments": ""}
    else:
        assert call.id is None and call.type is None and call.function.name is None, "header sent twice"
    calls[call.index]["arguments"] += call.function.arguments or ""


def check_non_streaming(parser, output, request, content, expected_calls):
    info = parser.extract_tool_calls(output, request)
    assert info.content == content
    assert info.tools_called == bool(expected_calls)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in info.tool_calls] == expected_calls
    for call in info.tool_calls:
        assert re.fullmatch(r"call_[0-9a-f]{24}", call.id) and call.type == "function"
    return info


def check_streaming(parser_cls, tokenizer, output, request, tokens_per_step=1):
    expected = parser_cls(tokenizer).extract_tool_calls(output, request)
    parser = parser_cls(tokenizer)
    content, calls = stream_tool_calls(parser, tokenizer, output, request, tokens_per_step)
    assert content == (expected.content or "")
    assert [calls[i]["name"] for i in sorted(calls)] == [c.function.name for c in expected.tool_calls]
    assert [calls[i]["arguments"] for i in sorted(calls)] == [c.function.arguments for c in expected.tool_calls]
    assert [json.loads(calls[i]["arguments"]) for i in sorted(calls)] == [
        json.loads(c.function.arguments) for c in expected.tool_calls]
    assert len({c["id"] for c in calls.values()}) == len(calls)
    assert [c["name"] for c in parser.prev_tool_call_arr] == [c.function.name for c in expected.tool_calls]
    assert parser.streamed_args_for_tool == [c.function.arguments for c in expected.tool_calls]


def test_registry():
    assert get_tool_parser("qwen3_coder") is Qwen3CoderToolParser
    assert get_tool_parser("hermes") is Hermes2ProToolParser
    with pytest.raises(ParserNotFoundError, match="hermes, qwen3_coder"):
        get_tool_parser("qwen3_xml_v9")


@pytest.mark.parametrize("name,output,content,calls", QWEN3_CODER_CASES, ids=[c[0] for c in QWEN3_CODER_CASES])
def test_qwen3_coder_extract(tokenizer, name, output, content, calls):
    check_non_streaming(Qwen3CoderToolParser(tokenizer), output, chat_request(), content, calls)


@pytest.mark.parametrize("tokens_per_step", [1, 4, 10_000])
@pytest.mark.parametrize("name,output,content,calls", QWEN3_CODER_CASES, ids=[c[0] for c in QWEN3_CODER_CASES])
def test_qwen3_coder_streaming(tokenizer, name, output, content, calls, tokens_per_step):
    check_streaming(Qwen3CoderToolParser, tokenizer, output, chat_request(), tokens_per_step)


def test_qwen3_coder_without_request_keeps_strings(tokenizer):
    info = Qwen3CoderToolParser(tokenizer).extract_tool_calls(xml_call("get_weather", {"days": "3"}), None)
    assert json.loads(info.tool_calls[0].function.arguments) == {"days": "3"}


def test_qwen3_coder_streams_parameters_as_they_close(tokenizer):
    output = "Checking.\n\n" + xml_call("get_weather", {"city": "Dallas", "state": "TX", "days": "3"})
    parser = Qwen3CoderToolParser(tokenizer)
    fragments = []
    for s in token_deltas(tokenizer, output):
        delta = parser.extract_tool_calls_streaming(s.previous_text, s.current_text, s.delta_text,
                                                    s.previous_token_ids, s.current_token_ids, s.delta_token_ids,
                                                    chat_request())
        fragments += [c.function.arguments for c in (delta.tool_calls if delta else []) if c.function.arguments]
    # the last value is complete once the call's end is certain (a </function> followed by </tool_call>)
    assert fragments == ["{", '"city": "Dallas"', ', "state": "TX"', ', "days": 3}']
    assert parser.finish_streaming(output, chat_request()) is None


def test_qwen3_coder_holds_back_partial_function_tag(tokenizer):
    parser = Qwen3CoderToolParser(tokenizer)
    request = chat_request()
    first = parser.extract_tool_calls_streaming("", "Hi <func", "Hi <func", [], [], [], request)
    assert first.content == "Hi "
    assert parser.extract_tool_calls_streaming("Hi <func", "Hi <function=", "tion=", [], [], [], request) is None
    # A held-back "<" that turns out to be plain text is sent with the next delta, or at the end.
    parser = Qwen3CoderToolParser(tokenizer)
    assert parser.extract_tool_calls_streaming("", "a <", "a <", [], [], [], request).content == "a "
    assert parser.finish_streaming("a <", request).content == "<"


@pytest.mark.parametrize("name,output,content,calls", HERMES_CASES, ids=[c[0] for c in HERMES_CASES])
def test_hermes_extract(tokenizer, name, output, content, calls):
    check_non_streaming(Hermes2ProToolParser(tokenizer), output, chat_request(), content, calls)


@pytest.mark.parametrize("tokens_per_step", [1, 3])
@pytest.mark.parametrize("name,output,content,calls", HERMES_CASES, ids=[c[0] for c in HERMES_CASES])
def test_hermes_streaming(tokenizer, name, output, content, calls, tokens_per_step):
    check_streaming(Hermes2ProToolParser, tokenizer, output, chat_request(), tokens_per_step)


def test_hermes_broken_json_ends_at_the_first_end_tag(tokenizer):
    # A string left open would run the call to the end of the text; a model that wrote broken JSON meant the first
    # `</tool_call>`, so the whole output's next call is kept (streamed, the broken call's name has already gone out).
    output = ('<tool_call>{"name": "a", "arguments": {"q": "open}</tool_call>\n<tool_call>{"name": "b", "arguments": '
              '{}}</tool_call>')
    check_non_streaming(Hermes2ProToolParser(tokenizer), output, chat_request(), None, [("b", {})])


def test_hermes_call_cut_off_keeps_its_raw_arguments(tokenizer):
    """An output that ends inside a call (max_tokens) returns it with the arguments text as far as it got, whole and
    streamed alike (the stream has sent the name already)."""
    output = 'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Da'
    info = Hermes2ProToolParser(tokenizer).extract_tool_calls(output, chat_request())
    assert info.content == "Sure." and [(c.function.name, c.function.arguments) for c in info.tool_calls] == [
        ("get_weather", '{"city": "Da')]
    content, calls = stream_tool_calls(Hermes2ProToolParser(tokenizer), tokenizer, output, chat_request())
    assert content == "Sure." and [(c["name"], c["arguments"]) for c in calls.values()] == [
        ("get_weather", '{"city": "Da')]


def test_hermes_sends_name_before_arguments_close(tokenizer):
    output = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Dallas"}}\n</tool_call>'
    parser = Hermes2ProToolParser(tokenizer)
    steps = token_deltas(tokenizer, output)
    names_at = [i for i, s in enumerate(steps) if (d := parser.extract_tool_calls_streaming(
        s.previous_text, s.current_text, s.delta_text, s.previous_token_ids, s.current_token_ids,
        s.delta_token_ids, chat_request())) and d.tool_calls and d.tool_calls[0].function.name]
    assert len(names_at) == 1 and names_at[0] < len(steps) - 3


# Reasoning, then tool calls: the server feeds the tool parser only what the reasoning parser calls content.
PIPELINE_CASES = [
    ("after_think_end", "I should check the weather.\n</think>\n\n"
     + xml_call("get_weather", {"city": "Paris", "days": "3"}),
     "I should check the weather.\n", None, [("get_weather", {"city": "Paris", "days": 3})]),
    ("implicit_end_in_thinking", "I need to read the file.\n\n" + xml_call("bash", {"command": "cat f.txt"}),
     "I need to read the file.\n\n", None, [("bash", {"command": "cat f.txt"})]),
    ("answer_then_parallel_calls", "Plan.\n</think>\n\nI'll check both." + "\n\n"
     + xml_call("get_weather", {"city": "A"}) + "\n" + xml_call("get_weather", {"city": "B"}),
     "Plan.\n", "\n\nI'll check both.\n\n", [("get_weather", {"city": "A"}), ("get_weather", {"city": "B"})]),
    ("no_call", "Easy.\n</think>\n\nIt is 4.", "Easy.\n", "\n\nIt is 4.", []),
]


@pytest.mark.parametrize("name,output,reasoning,content,calls", PIPELINE_CASES, ids=[c[0] for c in PIPELINE_CASES])
def test_reasoning_then_tool_calls(tokenizer, name, output, reasoning, content, calls):
    request = chat_request()
    reasoning_parser = get_reasoning_parser("qwen3")(tokenizer)
    got_reasoning, after = reasoning_parser.extract_reasoning(output, request)
    assert got_reasoning == reasoning
    info = check_non_streaming(Qwen3CoderToolParser(tokenizer), after or "", request, content, calls)

    reasoning_parser = get_reasoning_parser("qwen3")(tokenizer)
    tool_parser = Qwen3CoderToolParser(tokenizer)
    streamed_reasoning, tool_text, streamed_content, streamed_calls = "", "", "", {}
    for s in token_deltas(tokenizer, output):
        delta = reasoning_parser.extract_reasoning_streaming(s.previous_text, s.current_text, s.delta_text,
                                                             s.previous_token_ids, s.current_token_ids,
                                                             s.delta_token_ids)
        streamed_reasoning += (delta.reasoning_content or "") if delta else ""
        if not (delta and delta.content):
            continue
        previous_tool_text, tool_text = tool_text, tool_text + delta.content
        tool_delta = tool_parser.extract_tool_calls_streaming(previous_tool_text, tool_text, delta.content,
                                                              [], [], [], request)
        for part in [tool_delta] if tool_delta else []:
            streamed_content += part.content or ""
            for call in part.tool_calls:
                collect_tool_call_delta(streamed_calls, call)
    final = tool_parser.finish_streaming(tool_text, request)
    for call in final.tool_calls if final else []:
        collect_tool_call_delta(streamed_calls, call)
    assert streamed_reasoning == reasoning
    assert streamed_content == (content or "")
    assert [(c["name"], c["arguments"]) for c in streamed_calls.values()] == [
        (c.function.name, c.function.arguments) for c in info.tool_calls]
