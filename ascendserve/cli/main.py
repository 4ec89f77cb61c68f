"""`ascendserve` command line: one subcommand per module under ascendserve.cli."""

import argparse
import importlib
import sys

# Each module defines `register(subparsers)`, which adds its subcommand and sets `func`.
SUBCOMMANDS = ["ascendserve.cli.generate", "ascendserve.cli.serve", "ascendserve.cli.bench"]


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand registered."""
    parser = argparse.ArgumentParser(prog="ascendserve", description=__doc__.split(":")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMANDS:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `ascendserve` console script (argv None: the process's own command line)."""
    if argv is None:
        from ascendserve.cli import allocator
        allocator.restart_with_preloaded_malloc()  # returns unless it restarts the process under tcmalloc
        line = allocator.describe(sys.argv[1:])
        if line:
            from ascendserve.logger import init_logger
            init_logger("ascendserve.cli.main").info(line)
    args = build_parser().parse_args(argv)
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
