"""The interface every tool-call parser implements (vLLM's ToolParser), with a shared stream driver."""

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ascendserve.entrypoints.openai.protocol import (ChatCompletionRequest, DeltaFunctionCall, DeltaMessage,
                                                     DeltaToolCall, ExtractedToolCallInformation,
                                                     FunctionCall, ToolCall, make_tool_call_id)
from ascendserve.logger import init_logger

logger = init_logger(__name__)


@dataclass
class StreamedCall:
    """One tool call as far as the text shows it."""

    # None while the name is still arriving.
    name: str | None
    # A prefix of the final arguments JSON that later text cannot change (all of it once the call is closed).
    stable_arguments: str = ""
    # The arguments parsed so far, for `prev_tool_call_arr`.
    arguments: Any = None


class ToolParser(ABC):
    """Finds tool calls in model text; make one per request, it keeps stream state.

    Subclasses say where the tool-call region starts and how to read the calls in it; this class turns
    that into non-streaming results and OpenAI stream deltas. Invariants of the stream:
      * text before the region is content; whitespace-only content is never sent (None when not
        streaming), text after the region starts is content only if no call in it parses (sent at the end);
      * each call gets one header delta (index, id, type, name), then argument fragments whose
        concatenation equals the non-streaming `arguments`, once `finish_streaming` has run.
    """

    # Strings that open the tool-call region; a text ending in a prefix of one is held back.
    start_markers: tuple[str, ...] = ()

    def __init__(self, tokenizer: Any):
        self.model_tokenizer = tokenizer
        # vLLM's names: the server reads these to set finish_reason="tool_calls".
        self.prev_tool_call_arr: list[dict[str, Any]] = []
        self.streamed_args_for_tool: list[str] = []
        self.current_tool_id = -1
        self._tool_call_ids: list[str] = []
        self._region_start: int | None = None
        self._content_sent = 0
        self._content_started = False
        self._awaiting_name = False

    def adjust_request(self, request: ChatCompletionRequest) -> ChatCompletionRequest:
        """Change the request before generation if the parser needs it (Qwen's tags are plain tokens: no-op)."""
        return request

    @abstractmethod
    def find_tool_calls_start(self, text: str, search_from: int) -> int | None:
        """Where the tool-call region starts in `text` (searching from `search_from`), or None."""

    @abstractmethod
    def parse_calls(self, region: str, request: ChatCompletionRequest | None, final: bool) -> list[StreamedCall]:
        """The calls in `region`; `final` means the text is complete (close whatever is open)."""

    def worth_parsing(self, delta_text: str) -> bool:
        """Whether `delta_text` may complete something (a tag or a name), so the region is parsed again."""
        return ">" in delta_text

    def extract_tool_calls(self, model_output: str,
                           request: ChatCompletionRequest | None) -> ExtractedToolCallInformation:
        """The tool calls of a whole output, and the content before them."""
        start = self.find_tool_calls_start(model_output, 0)
        calls = [] if start is None else self.parse_calls(model_output[start:], request, final=True)
        tool_calls = [ToolCall(function=FunctionCall(name=call.name, arguments=call.stable_arguments))
                      for call in calls if call.name is not None]
        # text that opened a tool-call region without a call in it that parses stays the model's content (vLLM's)
        content = model_output[:start] if tool_calls else model_output
        return ExtractedToolCallInformation(tools_called=bool(tool_calls), tool_calls=tool_calls,
                                            content=content if content.strip() else None)

    def extract_tool_calls_streaming(self, previous_text: str, current_text: str, delta_text: str,
                                     previous_token_ids: Sequence[int], current_token_ids: Sequence[int],
                                     delta_token_ids: Sequence[int],
                                     request: ChatCompletionRequest | None) -> DeltaMessage | None:
        """The content and tool-call deltas of one text delta, or None when it carries neither."""
        region_was_open = self._region_start is not None
        content = self._stream_content(current_text, final=False)
        tool_calls: list[DeltaToolCall] = []
        if self._region_start is not None and (
                not region_was_open or self._awaiting_name or self.worth_parsing(delta_text)):
            tool_calls = self._stream_calls(current_text, request, final=False)
        return _delta_message(content, tool_calls)

    def finish_streaming(self, current_text: str, request: ChatCompletionRequest | None) -> DeltaMessage | None:
        """Flush at the end of a stream: held-back content and the rest of any call left open."""
        content = self._stream_content(current_text, final=True)
        tool_calls = [] if self._region_start is None else self._stream_calls(current_text, request, final=True)
        if self._region_start is not None and not self._tool_call_ids:  # no call in it: the held text is content
            content += current_text[self._content_sent:]
            self._content_sent = len(current_text)
        return _delta_message(content, tool_calls)

    def _stream_content(self, current_text: str, final: bool) -> str:
        if self._region_start is None:
            self._region_start = self.find_tool_calls_start(current_text, self._content_sent)
        if self._region_start is not None:
            limit = self._region_start
        elif final:
            limit = len(current_text)
        else:
            limit = len(current_text) - _partial_marker_length(current_text, self.start_markers)
        text = current_text[self._content_sent:max(limit, self._content_sent)]
        if not self._content_started and not text.strip():
            return ""  # leading whitespace waits: sent with the first real content, dropped before a call
        self._content_started = True
        self._content_sent = max(limit, self._content_sent)
        return text

    def _stream_calls(self, current_text: str, request: ChatCompletionRequest | None,
                      final: bool) -> list[DeltaToolCall]:
        calls = self.parse_calls(current_text[self._region_start:], request, final)
        self._awaiting_name = not calls or calls[-1].name is None
        deltas = []
        for index, call in enumerate(calls):
            if call.name is None:
                break
            delta = self._call_delta(index, call)
            if delta is not None:
                deltas.append(delta)
        return deltas

    def _call_delta(self, index: int, call: StreamedCall) -> DeltaToolCall | None:
        is_new = index == len(self._tool_call_ids)
        if is_new:
            self._tool_call_ids.append(make_tool_call_id())
            self.streamed_args_for_tool.append("")
            self.prev_tool_call_arr.append({"name": call.name, "arguments": {}})
            self.current_tool_id = index
        if call.arguments is not None:
            self.prev_tool_call_arr[index]["arguments"] = call.arguments
        sent = self.streamed_args_for_tool[index]
        if not call.stable_arguments.startswith(sent):
            logger.warning("tool call %d changed arguments already streamed (%r, now %r); not resending",
                           index, sent, call.stable_arguments)
            fragment = ""
        else:
            fragment = call.stable_arguments[len(sent):]
        self.streamed_args_for_tool[index] = sent + fragment
        if is_new:
            return DeltaToolCall(index=index, id=self._tool_call_ids[index], type="function",
                                 function=DeltaFunctionCall(name=call.name, arguments=fragment))
        return DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=fragment)) if fragment else None


def _partial_marker_length(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is a proper prefix of a marker ("…<tool" -> 5)."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:size]):
                longest = size
                break
    return longest


def _delta_message(content: str, tool_calls: list[DeltaToolCall]) -> DeltaMessage | None:
    fields: dict[str, Any] = {}
    if content:
        fields["content"] = content
    if tool_calls:
        fields["tool_calls"] = tool_calls
    return DeltaMessage(**fields) if fields else None
