"""The interface every reasoning parser implements (vLLM's ReasoningParser)."""

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from ascendserve.entrypoints.openai.protocol import ChatCompletionRequest, DeltaMessage


class ReasoningParser(ABC):
    """Splits a model's output into reasoning and content; make one per request, it keeps stream state."""

    def __init__(self, tokenizer: Any, chat_template_kwargs: dict[str, Any] | None = None):
        self.model_tokenizer = tokenizer
        self.chat_template_kwargs = dict(chat_template_kwargs or {})

    @abstractmethod
    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        """Whether the reasoning is over at the end of `input_ids` (a prompt or an output so far)."""

    @abstractmethod
    def extract_content_ids(self, input_ids: Sequence[int]) -> list[int]:
        """The ids of `input_ids` that belong to the content (after the reasoning)."""

    @abstractmethod
    def extract_reasoning(self, model_output: str,
                          request: ChatCompletionRequest | None) -> tuple[str | None, str | None]:
        """Split a whole output into (reasoning, content); either is None when empty."""

    @abstractmethod
    def extract_reasoning_streaming(self, previous_text: str, current_text: str, delta_text: str,
                                    previous_token_ids: Sequence[int], current_token_ids: Sequence[int],
                                    delta_token_ids: Sequence[int]) -> DeltaMessage | None:
        """The reasoning and content of one delta, or None when it carries neither."""

    @property
    @abstractmethod
    def reasoning_ended(self) -> bool:
        """Whether the stream seen so far has left the reasoning (what follows is content)."""
