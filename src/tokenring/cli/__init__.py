"""Command line: ``tokenring <command> [options]``.

A thin layer: each command's module has ``add_arguments(parser)``, optionally
``check_args(args)``, and ``run(args) -> int``, and is imported only when its command runs;
algorithms never import this package. ``main(argv) -> int`` is what tests call in-process.

Note [Bad input at the command line]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Every mistake in the arguments ends the command before any work starts (before a rank is
spawned or a simulation allocates), as argparse ends it: one line on stderr naming the
argument, the value and what was expected, exit status 2, the usage left behind ``--help``.
One argument alone is checked by the ``type=`` functions below (``int_at_least``,
``output_path``, ...) while parsing; arguments together (a sequence the layout cannot
split, a link too slow for the timeout, a run that cannot fit in memory) by the command's
``check_args(args)``, whose ``ValueError`` :func:`main` turns into the same one-line error.

A run that fails after it started (a rank raised or died, ``--timeout`` passed) ends the same
way with exit status 1: one line naming the root cause, the rank that failed first and its
error where it was raised (``RunFailed``), not the launcher's traceback.

An option the run would not read (one for another ``--mode``, another strategy, or an
output the run does not write) is such a mistake whatever its value: a check asks whether
the user gave it (``given(args, name)``, from the words on the command line), never whether
its value differs from the default, which let ``bench --mode memory --seq 1024`` (the
default) through where ``--seq 4096`` was refused.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NoReturn, Protocol

__all__ = [
    "MAX_INT",
    "MAX_TIMEOUT_S",
    "ArgumentAdder",
    "HelpFormatter",
    "RunFailed",
    "build_parser",
    "check_heads",
    "check_unique",
    "finite_float_at_least",
    "given",
    "int_at_least",
    "int_list",
    "main",
    "mem_available_bytes",
    "options",
    "output_path",
    "positive_seconds",
    "rate_bits_per_s",
    "split_list",
]

# command -> its one-line help; its module, tokenring.cli.<command>, is imported only when it runs
COMMANDS: dict[str, str] = {
    "demo": "check every strategy against the oracle on CPU ranks and time it",
    "bench": "every strategy side by side: verified, timed, against its bound",
    "simulate": "predict every strategy's time on a described machine",
}


class RunFailed(Exception):
    """A run that failed after it started; :func:`main` prints its message as one line and
    returns 1 (Note [Bad input at the command line])."""


class ArgumentAdder(Protocol):
    """A parser or one of its argument groups: what a command's ``add_arguments`` fills."""

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action: ...


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (Note [Bad input at the command line])."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see --help)\n")


# -- argument types: argparse reports their errors as "argument --flag: <message>" -------------
def _checked(
    cast: Callable[[str], Any], expected: str, ok: Callable[[Any], bool]
) -> Callable[[str], Any]:
    """An argparse ``type``: ``cast(text)`` where it is ``ok``, else "must be <expected>"."""

    def parse(text: str) -> Any:
        try:
            value = cast(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"must be {expected}; got {text!r}")
        return value

    return parse


def _finite(text: str) -> float | None:
    value = float(text)
    return value if math.isfinite(value) else None


MAX_INT = 2**63 - 1
"""The largest size a flag takes (int64's): beyond it a size cannot index a tensor, and
products of sizes overflowed floats (10**400 ended in an OverflowError traceback)."""
MAX_TIMEOUT_S = 10**7
"""``--timeout`` is below this, a communicator's limit (``tokenring.runtime.comm``, which this
module does not import: ``tokenring --help`` imports no torch)."""


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer >= ``minimum`` (and at most :data:`MAX_INT`)."""
    at_least = _checked(int, f"an integer >= {minimum}", lambda v: v >= minimum)

    def parse(text: str) -> int:
        value = int(at_least(text))
        if value > MAX_INT:
            raise argparse.ArgumentTypeError(f"must be an integer <= 2**63 - 1; got {text!r}")
        return value

    return parse


def positive_seconds(text: str) -> float:
    """An argparse ``type``: a finite number of seconds > 0 and below :data:`MAX_TIMEOUT_S`
    (inf or nan: no deadline; 1e10 failed in every rank, after the start)."""
    seconds = float(_checked(_finite, "a finite number of seconds > 0", lambda v: v > 0)(text))
    if seconds >= MAX_TIMEOUT_S:
        raise argparse.ArgumentTypeError(
            f"must be below {MAX_TIMEOUT_S:g} seconds (a communicator's limit); got {text!r}"
        )
    return seconds


def finite_float_at_least(minimum: float) -> Callable[[str], float]:
    """An argparse ``type``: a finite number >= ``minimum`` (a nan bound passes nothing)."""
    return _checked(_finite, f"a finite number >= {minimum:g}", lambda v: v >= minimum)


def output_path(text: str) -> str:
    """An argparse ``type``: a file the command can write when it is done, checked before any
    work (not after an hour's run)."""
    if not text:
        raise argparse.ArgumentTypeError("must be a file path; got ''")
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"must be a file path; got the directory {text!r}")
    parent = os.path.dirname(os.path.abspath(text))
    if os.path.exists(parent) and not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(
            f"{parent!r} is a file, not a directory (for {text!r}); got a path under a file"
        )
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(
            f"directory {parent!r} does not exist (for {text!r}); create it first"
        )
    if os.path.exists(text):
        if not os.access(text, os.W_OK):
            raise argparse.ArgumentTypeError(f"file {text!r} is not writable")
    elif not os.access(parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"directory {parent!r} is not writable (for {text!r})")
    return text


def rate_bits_per_s(text: str) -> float:
    """An argparse ``type``: a link rate, '100mbit', '1gbit', '400M', '2.5e8' -> bits/s >= 1."""
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "g": 1e9, "m": 1e6, "k": 1e3, "bit": 1.0}
    lowered = text.strip().lower()
    suffix = next((u for u in units if lowered.endswith(u)), "")
    number, scale = lowered[: len(lowered) - len(suffix)], units.get(suffix, 1.0)
    try:
        value = float(number) * scale
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 1):
        raise argparse.ArgumentTypeError(
            f"must be a rate of at least 1 bit/s like 100mbit or 1gbit; got {text!r}"
        )
    return value


def mem_available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (what the kernel can hand out without
    swapping); None where there is none."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the file says kB and means KiB
    except (OSError, ValueError, IndexError):
        return None
    return None


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with each option's default, unless the help already says it or there is
    none to say (None, False)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS):
            return text
        return super()._get_help_string(action)


# -- arguments together ------------------------------------------------------------------------
def split_list(text: str, flag: str, parse: Any, expected: str) -> tuple[Any, ...]:
    """Parse a comma-separated flag; ValueError naming the flag and the bad item."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise ValueError(f"{flag} must list at least one of {expected}; got {text!r}")
    out = []
    for item in items:
        try:
            out.append(parse(item))
        except ValueError:
            raise ValueError(f"{flag}: unknown {item!r}; expected any of {expected}") from None
    return check_unique(flag, tuple(out))


def check_unique(flag: str, values: Sequence[Any]) -> Any:
    """``values`` when no two are equal; else ValueError naming the flag and the repeated one
    (a repeat would run or print the same row twice)."""
    seen: list[Any] = []
    for value in values:
        if value in seen:
            shown = getattr(value, "value", value)
            raise ValueError(f"{flag} lists {shown!r} more than once; got {list(values)!r}")
        seen.append(value)
    return values


def options(args: argparse.Namespace, *names: str) -> dict[str, Any]:
    """The arguments of these names: a config's fields that its options set as they are."""
    return {name: getattr(args, name) for name in names}


def int_list(text: str, name: str, minimum: int) -> tuple[int, ...]:
    """Comma-separated integers >= minimum; ValueError naming the flag."""
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        values = ()
    if not values or min(values) < minimum:
        raise ValueError(f"{name} must be comma-separated integers >= {minimum}; got {text!r}")
    if max(values) > MAX_INT:
        raise ValueError(f"{name} must be comma-separated integers <= 2**63 - 1; got {text!r}")
    return check_unique(name, values)


def check_heads(args: argparse.Namespace) -> None:
    if (args.heads is None) != (args.kv_heads is None):
        given = "--heads" if args.heads is not None else "--kv-heads"
        raise ValueError(f"--heads and --kv-heads go together; got {given} alone")
    if args.heads is not None and args.heads % args.kv_heads:
        raise ValueError(
            f"--kv-heads must divide --heads; got --heads {args.heads} --kv-heads {args.kv_heads}"
        )


def given(args: argparse.Namespace, *names: str) -> bool:
    """Whether the command line gave any option of these names (dests), at whatever value
    (Note [Bad input at the command line]); :func:`main` records them."""
    return not args._given.isdisjoint(names)


def _given_options(
    parser: argparse.ArgumentParser, argv: Sequence[str], dests: Iterable[str]
) -> frozenset[str]:
    """The dests of the options ``argv`` sets on ``parser`` (a command's): parsed again into a
    namespace that holds a marker for every dest, which argparse leaves where no word set it
    (it fills defaults only into attributes a namespace lacks)."""
    unset = object()
    probe = argparse.Namespace(**dict.fromkeys(dests, unset))
    parser.parse_args(argv, namespace=probe)
    return frozenset(name for name, value in vars(probe).items() if value is not unset)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only ``command``'s module is imported and its options added (the others
    are listed by name and one-line help, which is all ``tokenring --help`` shows)."""
    parser = _Parser(
        prog="tokenring",
        description="Sequence-parallel attention: TokenRing, Ring and friends.",
        formatter_class=HelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in COMMANDS.items():
        if name != command:
            sub.add_parser(name, help=help_text)
            continue
        module = importlib.import_module(f"tokenring.cli.{name}")
        summary = (module.__doc__ or help_text).split("\n\n")[0]  # the Notes stay in the code
        parser_of_command = sub.add_parser(
            name, help=help_text, description=summary, formatter_class=HelpFormatter
        )
        module.add_arguments(parser_of_command)
        parser_of_command.set_defaults(_module=module, _parser=parser_of_command)
    return parser


def _check_outputs_apart(args: argparse.Namespace) -> None:
    """Raise ValueError when two output options (``type=output_path``) name the same file:
    each writes its own, and the later one overwrote the earlier (``--out t --markdown t``
    left the page where the JSON rows were appended; ``--plot t --trace t`` the trace)."""
    seen: dict[str, str] = {}  # real path -> "--flag 'path'"
    for action in args._parser._actions:
        path = getattr(args, action.dest, None)
        if action.type is not output_path or path is None:
            continue
        given_as = f"{max(action.option_strings, key=len)} {path!r}"
        first = seen.setdefault(os.path.realpath(path), given_as)
        if first != given_as:
            raise ValueError(f"{first} and {given_as} name the same file; each writes its own")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status instead of exiting.

    Raises:
        SystemExit: status 2 for bad arguments (one line on stderr), as argparse does.

    A run that failed after it started (``RunFailed``): its one line on stderr, status 1.
    """
    argv = list(argv) if argv is not None else sys.argv[1:]
    # the top level has no options but --help: the first word that is not one names the command
    command = next((word for word in argv if not word.startswith("-")), None)
    parser = build_parser(command)
    args = parser.parse_args(argv)
    rest = argv[argv.index(args.command) + 1 :]  # the words of the command's own parser
    args._given = _given_options(args._parser, rest, vars(args))
    args.argv = argv  # so results can record the command that produced them
    check = getattr(args._module, "check_args", None)
    try:
        _check_outputs_apart(args)
        if check is not None:
            check(args)
    except ValueError as exc:
        args._parser.error(str(exc))
    try:
        return int(args._module.run(args))
    except RunFailed as exc:
        print(f"{args._parser.prog}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
