"""The ``exitlm`` command. Each sub-package registers its own sub-commands here."""

from __future__ import annotations

import argparse
import importlib
import sys

# Modules exposing ``register(subparsers)``; each adds sub-commands with
# ``set_defaults(func=...)`` where ``func(args) -> int`` is the exit status.
_COMMAND_MODULES: tuple[str, ...] = (
    "exitlm.io.cli", "exitlm.infer.cli", "exitlm.plan.cli", "exitlm.train.cli",
    "exitlm.infer.bench_cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="exitlm", description="Train and serve early-exit language models."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
