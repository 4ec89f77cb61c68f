"""`ascendserve` command line: one subcommand per module under ascendserve.cli."""

import argparse
import importlib
import sys

from ascendserve.cli.config_file import config_arguments, normalize_flag_names

# Each module defines `register(subparsers)`, which adds its subcommand and sets `func`.
SUBCOMMANDS = ["ascendserve.cli.generate", "ascendserve.cli.serve", "ascendserve.cli.bench"]


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand registered."""
    from ascendserve.version import __version__

    parser = argparse.ArgumentParser(prog="ascendserve", description=__doc__.split(":")[0])
    parser.add_argument("-v", "--version", action="version", version=__version__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMANDS:
        importlib.import_module(name).register(sub)
    _mark_leaves(parser)
    return parser


def _mark_leaves(parser: argparse.ArgumentParser) -> None:
    """Each subcommand's parser records itself (`_parser`), so that an unknown flag is reported by the parser of
    the command it was given to, with that command's usage line; none takes abbreviated flags."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                child.set_defaults(_parser=child)
                child.allow_abbrev = False  # "--n" must not pass for some --n... flag (vLLM's parsers refuse it too)
                _mark_leaves(child)


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """parse_args as vLLM's parser reads a command line (`--flag_name` with underscores; `serve --config FILE`,
    whose flags go before the command line's so that those win), with `unrecognized arguments` reported by the
    subcommand's own parser."""
    argv = normalize_flag_names(sys.argv[1:] if argv is None else list(argv))
    args, unknown = parser.parse_known_args(argv)
    path = getattr(args, "config_file", None)
    if path is not None:
        sub = args._parser
        at = argv.index(args.command) + 1
        argv = argv[:at] + config_arguments(sub, path, bool(args.model or args.model_tag)) + argv[at:]
        args, unknown = parser.parse_known_args(argv)
    if unknown:
        getattr(args, "_parser", parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def main(argv: list[str] | None = None, command: tuple[str, ...] = ()) -> int:
    """Entry point of the `ascendserve` console script and `python -m ascendserve` (argv None: the process's own
    command line, after `command`: `python -m ascendserve.entrypoints.openai.api_server --model M` is `serve`)."""
    if argv is None:
        from ascendserve.cli import allocator
        argv = [*command, *sys.argv[1:]]
        allocator.restart_with_preloaded_malloc(argv)  # returns unless it restarts the process under tcmalloc
        line = allocator.describe(argv)
        if line:
            from ascendserve.logger import init_logger
            init_logger("ascendserve.cli.main").info(line)
    args = parse_args(build_parser(), argv)
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
