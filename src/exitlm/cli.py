"""The ``exitlm`` command. Each sub-package registers its own sub-commands here.

Errors: an :class:`~exitlm.errors.ExitlmError` (bad input) is printed as one line,
``exitlm <command>: error: <message>``, plus its hint, and the command exits with status 2;
``exitlm --debug ...`` (or ``EXITLM_DEBUG=1``) shows the traceback instead. Warnings print as
``exitlm: warning: <message>``. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
import traceback
import warnings
from collections.abc import Iterator
from typing import Any, NoReturn

from exitlm.env import DEBUG
from exitlm.env import debug as env_debug
from exitlm.errors import ExitlmError, ExitlmWarning

# Modules exposing ``register(subparsers)``; each adds sub-commands with
# ``set_defaults(func=...)`` where ``func(args) -> int`` is the exit status.
_COMMAND_MODULES: tuple[str, ...] = (
    "exitlm.io.cli", "exitlm.infer.cli", "exitlm.plan.cli", "exitlm.train.cli",
    "exitlm.bench.cli", "exitlm.eval.cli",
    "exitlm.serve.cli",
)


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (``exitlm eval: error: ...`` and a hint) instead of a
    usage dump; sub-command parsers inherit it."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n"
                     f"  hint: see '{self.prog} --help'\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="exitlm", description="Train and serve early-exit language models."
    )
    parser.add_argument("--debug", action="store_true",
                        help="show the full traceback of an error (also EXITLM_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse ``argv``. A sub-command that sets ``extra_positionals=DEST`` (a list
    positional) also takes positionals that options separate from the first ones
    (``train -c tiny a=1 --resume b=2``), which plain argparse rejects; anything else
    unrecognized is an error of the sub-command's parser, naming the arguments."""
    args, extra = parser.parse_known_args(argv)
    if not extra:
        return args
    dest = getattr(args, "extra_positionals", None)
    stray = [a for a in extra if a.startswith("-")] if dest else extra
    command = getattr(args, "command", None)
    sub = subparsers(parser).get(command) if command else None
    if stray or not dest:
        (sub or parser).error(f"unrecognized arguments: {' '.join(stray or extra)}")
    getattr(args, dest).extend(extra)
    return args


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The sub-command parsers of ``parser`` by name (empty if it has none)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse(parser, argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    debug = bool(args.debug) or env_debug()
    name = f"exitlm {args.command}"
    with warnings.catch_warnings(), _debug_env(debug):
        warnings.showwarning = _show_warning
        try:
            return int(args.func(args) or 0)
        except ExitlmError as err:
            if debug:
                traceback.print_exc()
            print(error_lines(name, err), file=sys.stderr)
            return 2
        except MemoryError:
            if debug:
                traceback.print_exc()
            print(f"{name}: error: out of memory", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print(f"{name}: interrupted", file=sys.stderr)
            return 130


@contextlib.contextmanager
def _debug_env(debug: bool) -> Iterator[None]:
    """``EXITLM_DEBUG=1`` while a ``--debug`` command runs: the code below the command line
    (``comm``'s quiet rendezvous) and the processes it starts keep their details too."""
    if not debug or env_debug():
        yield
        return
    os.environ[DEBUG] = "1"
    try:
        yield
    finally:
        os.environ.pop(DEBUG, None)


def error_lines(command: str, err: ExitlmError) -> str:
    """``<command>: error: <first line of the message>`` and, when given, the hint."""
    text = " ".join(str(err).split()) or type(err).__name__
    out = f"{command}: error: {text}"
    if err.hint:
        out += f"\n  hint: {' '.join(err.hint.split())}"
    return out


def _show_warning(message: Any, category: type[Warning], filename: str, lineno: int,
                  file: Any = None, line: str | None = None) -> None:
    stream = file if file is not None else sys.stderr
    if issubclass(category, ExitlmWarning):
        stream.write(f"exitlm: warning: {message}\n")
    else:
        stream.write(warnings.formatwarning(message, category, filename, lineno, line))


if __name__ == "__main__":
    sys.exit(main())
