"""Qwen3 / Qwen3.5 reasoning parser (`--reasoning-parser qwen3`)."""

from collections.abc import Sequence
from typing import Any

from ascendserve.entrypoints.openai.protocol import ChatCompletionRequest, DeltaMessage
from ascendserve.parsers.reasoning.abs_reasoning_parser import ReasoningParser

THINK_START = "<think>"
THINK_END = "</think>"
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
# A tag split over two deltas is still found when the search starts this far back.
_TAG_OVERLAP = max(len(THINK_END), len(TOOL_CALL_START)) - 1


class Qwen3ReasoningParser(ReasoningParser):
    """Reasoning runs up to `</think>`, or up to a `<tool_call>` reached before it; the rest is content.

    Qwen3.5's template opens `<think>` in the prompt, so outputs usually hold only `</think>`; a leading
    `<think>` is dropped. With thinking on, an output without either tag is all reasoning (it was cut
    short); with `enable_thinking: false` everything is content. Examples (thinking on):
      "plan</think>\n\nanswer"         -> ("plan", "\n\nanswer")
      "plan\n<tool_call>\n<function=f>" -> ("plan\n", "<tool_call>\n<function=f>")
      "still thinking"                 -> ("still thinking", None)
    Tags are single tokens in Qwen's vocabulary, so a delta never holds part of one.
    """

    def __init__(self, tokenizer: Any, chat_template_kwargs: dict[str, Any] | None = None):
        super().__init__(tokenizer, chat_template_kwargs)
        self.start_token_id = self._token_id(THINK_START)
        self.end_token_id = self._token_id(THINK_END)
        self.tool_call_start_id = self._token_id(TOOL_CALL_START, required=False)
        self.tool_call_end_id = self._token_id(TOOL_CALL_END, required=False)
        self.thinking_enabled = _thinking_enabled(self.chat_template_kwargs)
        # Stream state: where the content starts in the output text, once known.
        self._content_start: int | None = None

    def _token_id(self, token: str, required: bool = True) -> int | None:
        token_id = self.model_tokenizer.convert_tokens_to_ids(token)
        if token_id is None or token_id == getattr(self.model_tokenizer, "unk_token_id", None):
            if required:
                raise ValueError(f"the qwen3 reasoning parser needs the {token} token, "
                                 f"which this tokenizer does not have")
            return None
        return token_id

    @property
    def reasoning_ended(self) -> bool:
        """Whether the stream seen so far has left the reasoning (what follows is content)."""
        return not self.thinking_enabled or self._content_start is not None

    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        """Scan back: `<think>` -> False, `</think>` or an unclosed `<tool_call>` -> True."""
        if not self.thinking_enabled:
            return True
        open_calls = 0  # </tool_call> seen (scanning back) whose <tool_call> is still ahead
        for token_id in reversed(input_ids):
            if token_id == self.start_token_id:
                return False
            if token_id == self.end_token_id:
                return True
            if token_id == self.tool_call_end_id:
                open_calls += 1
            elif token_id == self.tool_call_start_id:
                if open_calls == 0:
                    return True
                open_calls -= 1
        return False

    def extract_content_ids(self, input_ids: Sequence[int]) -> list[int]:
        """The ids after `</think>`, or from the first `<tool_call>` when that comes first."""
        if not self.thinking_enabled:
            return list(input_ids)
        for i, token_id in enumerate(input_ids):
            if token_id == self.end_token_id:
                return list(input_ids[i + 1:])
            if token_id == self.tool_call_start_id:
                return list(input_ids[i:])
        return []

    def extract_reasoning(self, model_output: str,
                          request: ChatCompletionRequest | None) -> tuple[str | None, str | None]:
        """Split a whole output into (reasoning, content); either is None when empty."""
        if not self._thinking_for(request):
            return None, model_output or None
        start = _reasoning_start(model_output)
        end, content_start = _find_reasoning_end(model_output, start)
        if end is None:
            return model_output[start:] or None, None
        return model_output[start:end] or None, model_output[content_start:] or None

    def extract_reasoning_streaming(self, previous_text: str, current_text: str, delta_text: str,
                                    previous_token_ids: Sequence[int], current_token_ids: Sequence[int],
                                    delta_token_ids: Sequence[int]) -> DeltaMessage | None:
        """The reasoning and content of one delta, or None when it carries neither."""
        if self.reasoning_ended:
            return DeltaMessage(content=delta_text) if delta_text else None
        base = len(previous_text)
        start = _reasoning_start(current_text)
        end, self._content_start = _find_reasoning_end(current_text, max(start, base - _TAG_OVERLAP))
        reasoning = current_text[max(base, start):len(current_text) if end is None else end]
        content = current_text[max(base, self._content_start):] if end is not None else ""
        fields = {"reasoning_content": reasoning, "content": content}
        fields = {name: text for name, text in fields.items() if text}
        return DeltaMessage(**fields) if fields else None

    def _thinking_for(self, request: ChatCompletionRequest | None) -> bool:
        kwargs = getattr(request, "chat_template_kwargs", None)
        return _thinking_enabled(kwargs) if kwargs is not None else self.thinking_enabled


def _thinking_enabled(chat_template_kwargs: dict[str, Any] | None) -> bool:
    return bool((chat_template_kwargs or {}).get("enable_thinking", True))


def _reasoning_start(text: str) -> int:
    return len(THINK_START) if text.startswith(THINK_START) else 0


def _find_reasoning_end(text: str, search_from: int) -> tuple[int | None, int | None]:
    """(where the reasoning ends, where the content starts) for the first end tag, or (None, None)."""
    think_end = text.find(THINK_END, search_from)
    tool_call = text.find(TOOL_CALL_START, search_from)
    if think_end >= 0 and (tool_call < 0 or think_end < tool_call):
        return think_end, think_end + len(THINK_END)
    if tool_call >= 0:
        return tool_call, tool_call
    return None, None
