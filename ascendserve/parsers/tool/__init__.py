"""Tool-call parsers by name, as vLLM's `--tool-call-parser`."""

from ascendserve.parsers import get_parser_class
from ascendserve.parsers.tool.abs_tool_parser import StreamedCall, ToolParser
from ascendserve.parsers.tool.hermes import Hermes2ProToolParser
from ascendserve.parsers.tool.qwen3_coder import Qwen3CoderToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "qwen3_coder": Qwen3CoderToolParser,
    "qwen3_xml": Qwen3CoderToolParser,  # vLLM's other parser of the same XML format
    "hermes": Hermes2ProToolParser,
}


def get_tool_parser(name: str) -> type[ToolParser]:
    """The tool parser class registered as `name`; raises ParserNotFoundError listing the known ones."""
    return get_parser_class("tool-call", TOOL_PARSERS, name)


__all__ = ["TOOL_PARSERS", "Hermes2ProToolParser", "Qwen3CoderToolParser", "StreamedCall", "ToolParser",
           "get_tool_parser"]
