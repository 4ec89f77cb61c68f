"""Qwen3-Coder / Qwen3.5 XML tool calls (`--tool-call-parser qwen3_coder`).

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Values are raw text (one framing newline each side is removed) converted by the JSON-schema type of the
parameter in `request.tools`. Missing `</parameter>`, `</function>` or `</tool_call>` are tolerated, and
a `<function=...>` with no `<tool_call>` around it is still a call.
"""

import re
from typing import Any

from ascendserve.entrypoints.openai.protocol import ChatCompletionRequest
from ascendserve.parsers.tool.abs_tool_parser import StreamedCall, ToolParser
from ascendserve.parsers.tool.schema_types import convert_param_value, dump_arguments, tool_properties

TOOL_CALL_START = "<tool_call>"
FUNCTION_PREFIX = "<function="

# A function body ends at a </function> that the call's end, the next call or the end of the text follows (one
# elsewhere is text inside a value), or where the next call or </tool_call> begins, or at the end.
_FUNCTION_RE = re.compile(r"<function=(.*?)(</function>(?=\s*(?:</tool_call>|<tool_call>|<function=|\Z))|"
                          r"(?=</tool_call>|<tool_call>|<function=)|\Z)", re.DOTALL)
# Within a body, a value ends at a </parameter> that the next parameter or the body's end follows (one elsewhere is
# text: code that mentions the tag), or where the next parameter begins (a missing </parameter>), or at the end.
_PARAMETER_RE = re.compile(r"<parameter=(.*?)(</parameter>(?=\s*(?:<parameter=|\Z))|(?=<parameter=)|\Z)", re.DOTALL)
# Names with these characters are unrendered template text, not calls.
BAD_NAME_RE = re.compile(r"""[{}<>"'\s]""")


class Qwen3CoderToolParser(ToolParser):
    """Tool calls in Qwen3-Coder's XML format, as Qwen3.5 emits them."""

    start_markers = (TOOL_CALL_START, FUNCTION_PREFIX)

    def find_tool_calls_start(self, text: str, search_from: int) -> int | None:
        """The first `<tool_call>` or bare `<function=`, whichever comes first."""
        found = [i for i in (text.find(m, search_from) for m in self.start_markers) if i >= 0]
        return min(found) if found else None

    def parse_calls(self, region: str, request: ChatCompletionRequest | None, final: bool) -> list[StreamedCall]:
        """Every `<function=...>` of the region; a call whose name is unusable is dropped."""
        calls = []
        for match in _FUNCTION_RE.finditer(region):
            closed = final or _decided(region, match)
            call = _parse_function(match.group(1), closed, request)
            if call is not None:
                calls.append(call)
        return calls


def _parse_function(body: str, closed: bool, request: ChatCompletionRequest | None) -> StreamedCall | None:
    """`body` is what follows `<function=`: `NAME>` and the parameters."""
    name_end = body.find(">")
    if name_end < 0:
        return None if closed else StreamedCall(name=None)
    name = body[:name_end].strip()
    if not name or BAD_NAME_RE.search(name):
        return None
    properties = tool_properties(request, name)
    complete: dict[str, Any] = {}
    seen: dict[str, Any] = {}
    for param_name, value, param_closed in _parameters(body[name_end + 1:], closed):
        if param_name in seen:
            continue  # a repeated name keeps its first value, so streamed prefixes stay valid
        seen[param_name] = convert_param_value(value, properties.get(param_name))
        if param_closed:
            complete[param_name] = seen[param_name]
    arguments = dump_arguments(complete)
    return StreamedCall(name=name, stable_arguments=arguments if closed else arguments[:-1], arguments=seen)


def _parameters(text: str, closed: bool) -> list[tuple[str, str, bool]]:
    """(name, value, complete) per parameter; one leading and one trailing newline of a value are framing."""
    params = []
    for match in _PARAMETER_RE.finditer(text):
        inner = match.group(1)
        name_end = inner.find(">")
        if name_end < 0:
            continue
        value = inner[name_end + 1:]
        if value.startswith("\n"):
            value = value[1:]
        if value.endswith("\n"):
            value = value[:-1]
        complete = closed or _decided(text, match)
        params.append((inner[:name_end].strip(), value, complete))
    return params


def _decided(text: str, match: re.Match) -> bool:
    """Whether a closing tag (or the start of what follows) really ends `match`: only once more than whitespace comes
    after it. Until then the tag may still turn out to be text inside a value (streaming waits one token)."""
    return bool(text[match.end():].strip())
