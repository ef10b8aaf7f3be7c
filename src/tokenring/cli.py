"""Command line: ``tokenring <command> [options]``.

A thin layer: each command lives in its own module exposing ``add_arguments(parser)`` and
``run(args) -> int``; algorithms never import this module. ``main(argv) -> int`` is what tests
call in-process.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

__all__ = ["main"]

# command name -> (module, one-line help). Modules are imported only when their command runs.
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("tokenring.demo", "check every strategy against the oracle on CPU ranks and time it"),
    "bench": ("tokenring.bench", "every strategy side by side: verified, timed, against its bound"),
    "simulate": ("tokenring.simulate", "predict every strategy's time on a described machine"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenring", description="Sequence-parallel attention: TokenRing, Ring and friends."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module_name, help_text) in COMMANDS.items():
        module = importlib.import_module(module_name)
        summary = (module.__doc__ or help_text).split("\n\n")[0]  # the Notes stay in the code
        command = sub.add_parser(name, help=help_text, description=summary)
        module.add_arguments(command)
        command.set_defaults(_module=module)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status instead of exiting."""
    parser = build_parser()
    argv = list(argv) if argv is not None else sys.argv[1:]
    args = parser.parse_args(argv)
    args.argv = argv  # so results can record the command that produced them
    status: int = args._module.run(args)
    return status


if __name__ == "__main__":
    sys.exit(main())
