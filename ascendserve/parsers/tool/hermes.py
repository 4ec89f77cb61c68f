"""Hermes-style JSON tool calls (`--tool-call-parser hermes`).

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
"""

import json
import re
from typing import Any

from ascendserve.entrypoints.openai.protocol import ChatCompletionRequest
from ascendserve.logger import init_logger
from ascendserve.parsers.tool.abs_tool_parser import StreamedCall, ToolParser
from ascendserve.parsers.tool.schema_types import dump_arguments

logger = init_logger(__name__)

TOOL_CALL_START = "<tool_call>"

TOOL_CALL_END = "</tool_call>"
# Inside a call's JSON: a string (to its closing quote, or to the end of the text while it is open) or the call's end.
# A `</tool_call>` inside a string value is text, not the end.
_STRING_OR_END_RE = re.compile(r'"(?:[^"\\]|\\(?:.|\Z))*(?:"|\Z)|</tool_call>', re.DOTALL)
_ARGUMENTS_KEY_RE = re.compile(r'\s*,\s*"(?:arguments|parameters)"\s*:\s*')
# The name, when the object starts with it, can be sent before the arguments are complete.
_LEADING_NAME_RE = re.compile(r'\A\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')


class Hermes2ProToolParser(ToolParser):
    """Tool calls as JSON objects inside `<tool_call>` tags; arguments stream when a call closes."""

    start_markers = (TOOL_CALL_START,)

    def find_tool_calls_start(self, text: str, search_from: int) -> int | None:
        """The first `<tool_call>`."""
        start = text.find(TOOL_CALL_START, search_from)
        return start if start >= 0 else None

    def parse_calls(self, region: str, request: ChatCompletionRequest | None, final: bool) -> list[StreamedCall]:
        """One call per `<tool_call>` block; a block that is not a JSON call object is dropped."""
        calls = []
        for body, closed in _blocks(region, final):
            if not (final or closed):
                call = StreamedCall(name=_leading_name(body))
            else:
                call = _parse_block(body) or (None if closed else _truncated_call(body))
            if call is not None:
                calls.append(call)
        return calls


def _blocks(region: str, final: bool):
    """(body, closed) of each `<tool_call>` block. A body that opens a JSON object ends at the first `</tool_call>`
    outside its strings; once the text is complete, one left open that way ends at the first `</tool_call>` at all
    (what a model that wrote broken JSON meant)."""
    start = region.find(TOOL_CALL_START)
    while start >= 0:
        body_start = start + len(TOOL_CALL_START)
        end = region.find(TOOL_CALL_END, body_start)
        if region[body_start:].lstrip().startswith("{"):
            ends = (m.start() for m in _STRING_OR_END_RE.finditer(region, body_start) if m.group() == TOOL_CALL_END)
            end = next(ends, -1 if not final else end)
        if end < 0:
            yield region[body_start:], False
            return
        yield region[body_start:end], True
        start = region.find(TOOL_CALL_START, end + len(TOOL_CALL_END))


def _truncated_call(body: str) -> StreamedCall | None:
    """A call the output ended inside (max_tokens): its name and the arguments text as far as it got (vLLM returns a
    forced call's raw arguments the same way), so streamed and whole replies agree."""
    name = _leading_name(body)
    if name is None:
        return None
    arguments = _ARGUMENTS_KEY_RE.search(body, _LEADING_NAME_RE.match(body).end())
    return StreamedCall(name=name, stable_arguments=body[arguments.end():].rstrip() if arguments else "")


def _leading_name(body: str) -> str | None:
    leading = _LEADING_NAME_RE.match(body)
    if leading is None:
        return None
    try:
        return json.loads(f'"{leading.group(1)}"') or None
    except ValueError:
        return None


def _parse_block(body: str) -> StreamedCall | None:
    try:
        obj = json.loads(body)
    except ValueError:
        logger.debug("tool call %r is not JSON; dropped", body)
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    arguments = _decode_string_arguments(arguments)
    return StreamedCall(name=obj["name"], stable_arguments=dump_arguments(arguments), arguments=arguments)


def _decode_string_arguments(arguments: Any) -> Any:
    # Some models send the arguments object JSON-encoded a second time.
    if isinstance(arguments, str):
        try:
            decoded = json.loads(arguments)
        except ValueError:
            return arguments
        return decoded if isinstance(decoded, dict) else arguments
    return arguments
