"""Reasoning parsers by name, as vLLM's `--reasoning-parser`."""

from ascendserve.parsers import get_parser_class
from ascendserve.parsers.reasoning.abs_reasoning_parser import ReasoningParser
from ascendserve.parsers.reasoning.qwen3 import Qwen3ReasoningParser

# deepseek_r1 is what vLLM's Qwen3.5 recipe once used; for these models it behaves like qwen3.
REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "qwen3": Qwen3ReasoningParser,
    "deepseek_r1": Qwen3ReasoningParser,
}


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The reasoning parser class registered as `name`; raises ParserNotFoundError listing the known ones."""
    return get_parser_class("reasoning", REASONING_PARSERS, name)


__all__ = ["REASONING_PARSERS", "Qwen3ReasoningParser", "ReasoningParser", "get_reasoning_parser"]
