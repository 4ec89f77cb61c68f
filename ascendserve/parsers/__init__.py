"""Reasoning and tool-call parsers that turn model text into OpenAI message fields (no torch)."""


class ParserNotFoundError(ValueError):
    """A reasoning or tool-call parser name that is not registered."""

    def __init__(self, kind: str, name: str, known: list[str]):
        super().__init__(f"unknown {kind} parser {name!r}; known {kind} parsers: {', '.join(sorted(known))}")
        self.name = name
        self.known = sorted(known)


def get_parser_class(kind: str, registry: dict[str, type], name: str) -> type:
    """Look `name` up in `registry`, raising ParserNotFoundError that lists the known names."""
    try:
        return registry[name]
    except KeyError:
        raise ParserNotFoundError(kind, name, list(registry)) from None
